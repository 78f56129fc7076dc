"""tests/suite_cache.py: a session fixture's product is built once per test run, by whichever xdist
worker asks first, waited for by the others; a failed build is never read nor retried in the run, a
killed one is built again."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.suite_cache import DONE, built_once, shared_root


class Worker:
    """An xdist worker's side of pytest's TempPathFactory (``BaseTemp``)."""

    def __init__(self, base: Path) -> None:
        base.mkdir(parents=True, exist_ok=True)
        self.base = base

    def getbasetemp(self) -> Path:
        return self.base


def test_two_workers_racing_for_a_product_build_it_once_and_both_read_it(tmp_path: Path) -> None:
    builds: list[str] = []

    def build(path: Path) -> None:
        builds.append(threading.current_thread().name)
        time.sleep(0.3)  # the other worker asks meanwhile
        (path / "out.txt").write_text("built")

    got: dict[str, Path] = {}

    def ask(name: str) -> None:
        got[name] = built_once(Worker(tmp_path / name), "product", build)

    threads = [threading.Thread(target=ask, args=(n,), name=n) for n in ("popen-gw0", "popen-gw1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    assert got["popen-gw0"] == got["popen-gw1"] == tmp_path / "product"
    assert (tmp_path / "product" / "out.txt").read_text() == "built" and (tmp_path / "product" / DONE).exists()


def test_a_failed_build_is_never_read_and_later_askers_fail_at_once_with_its_error(tmp_path: Path) -> None:
    worker, other = Worker(tmp_path / "popen-gw0"), Worker(tmp_path / "popen-gw1")

    def fails(path: Path) -> None:
        (path / "half.txt").write_text("half")
        raise RuntimeError("the job failed (1): rank 1 exited")

    with pytest.raises(RuntimeError, match=r"the job failed \(1\)"):
        built_once(worker, "product", fails)
    assert not (tmp_path / "product" / DONE).exists()

    def never(path: Path) -> None:
        raise AssertionError("a product whose build failed in this run is not built again")

    with pytest.raises(RuntimeError, match=r"product: another worker.s build of it failed in this run: RuntimeError"):
        built_once(other, "product", never)


def test_a_build_a_killed_worker_left_is_emptied_and_built_again(tmp_path: Path) -> None:
    (tmp_path / "product").mkdir()
    (tmp_path / "product" / "half.txt").write_text("half")  # no DONE, no FAILED: its worker died

    def build(path: Path) -> None:
        assert list(path.iterdir()) == []  # nothing of the killed build is left to be mistaken for output
        (path / "out.txt").write_text("built")

    assert built_once(Worker(tmp_path / "popen-gw0"), "product", build) == tmp_path / "product"
    assert sorted(p.name for p in (tmp_path / "product").iterdir()) == [DONE, "out.txt"]


def test_without_xdist_the_run_s_own_base_directory_is_the_shared_one(tmp_path: Path) -> None:
    assert shared_root(Worker(tmp_path / "pytest-7")) == tmp_path / "pytest-7"
    assert shared_root(Worker(tmp_path / "pytest-7" / "popen-gw3")) == tmp_path / "pytest-7"

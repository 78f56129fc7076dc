"""Hashing threads are kept for the life of the process, so a fork never meets one starting or
exiting (a child forked then deadlocks in CPython 3.11's after-fork code, gh-112275); a forked
writer that never starts anyway is killed and its save fails at once, named as such."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import torch

from pretrain.checkpointing.async_writer import BackgroundWrite
from tiering.digest import ChunkChecker, ChunkHashingSink, HashSpec, hash_file


class ThreadStarts:
    """The threads started while counting: ``threading.settrace`` runs its function first thing in
    every thread ``threading`` starts (3.11 has no audit event for a thread start)."""

    def __init__(self) -> None:
        self.started: set[int] = set()

    def _first_call(self, frame: object, event: str, arg: object) -> None:
        self.started.add(threading.get_ident())
        sys.settrace(None)  # this thread is counted: no tracing of its work

    def __enter__(self) -> ThreadStarts:
        threading.settrace(self._first_call)
        return self

    def __exit__(self, *exc: object) -> None:
        threading.settrace(None)  # type: ignore[arg-type]


def test_hashing_files_starts_no_thread_after_the_first(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(3 * 1024 * 1024 + 17))
    spec = HashSpec("xxh3-128", 1024 * 1024, 2)
    first = hash_file(path, spec)
    with ThreadStarts() as starts:
        for _ in range(20):
            assert hash_file(path, spec) == first
            with open(os.devnull, "wb") as devnull:
                sink = ChunkHashingSink(devnull, "xxh3-128", 1024 * 1024, 2)
                sink.write(path.read_bytes())
                assert sink.finish() == first
            checker = ChunkChecker(2)
            checker.check_span("blob", first, 0, memoryview(path.read_bytes()))
            assert checker.result() is None
    assert not starts.started, f"{len(starts.started)} threads started while hashing"


def test_a_writer_forked_after_the_parent_hashed_hashes_on_threads_of_its_own(tmp_path: Path) -> None:
    """The child inherits the registry of kept threads but none of the threads: it must start its own."""
    hash_file(Path(__file__), HashSpec("xxh3-128", 1024, 2))  # the parent's lanes exist now
    state = {"w": torch.randn(512, 512)}
    write = BackgroundWrite("fork", state, tmp_path / "state.pt", hashing=HashSpec("xxh3-128", 64 * 1024, 2))
    outcome = write.poll(block=True, timeout=60)
    assert outcome is not None and outcome.ok, outcome
    assert outcome.digest == hash_file(tmp_path / "state.pt", HashSpec("xxh3-128", 64 * 1024, 2))


def test_a_forked_writer_that_never_starts_is_killed_and_its_save_fails_at_once(tmp_path: Path) -> None:
    t0 = time.perf_counter()  # before the fork: the start timeout counts from it, not from the first poll
    write = BackgroundWrite("fork", {"x": torch.ones(3)}, tmp_path / "state.pt", fault="stuck-at-fork")
    write.start_timeout_s = 0.5
    pid = write.pid
    assert pid is not None
    while (outcome := write.poll()) is None:  # the trainer's non-blocking poll, once a step
        assert time.perf_counter() - t0 < 30
        time.sleep(0.05)
    assert not outcome.ok and f"pid {pid}) never started" in outcome.error and "gh-112275" in outcome.error
    assert 0.5 <= time.perf_counter() - t0 < 10
    try:
        os.kill(pid, 0)
        raise AssertionError(f"writer {pid} still exists")
    except ProcessLookupError:
        pass  # killed and reaped
    assert not (tmp_path / "state.pt").exists()


def test_a_blocking_wait_on_a_writer_that_never_starts_ends_too(tmp_path: Path) -> None:
    write = BackgroundWrite("fork", {"x": torch.ones(3)}, tmp_path / "state.pt", fault="stuck-at-fork")
    write.start_timeout_s = 0.5
    outcome = write.poll(block=True)  # the final step's wait: no timeout
    assert outcome is not None and not outcome.ok and "never started" in outcome.error

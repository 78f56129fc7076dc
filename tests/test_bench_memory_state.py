"""The bench's memory-state wait: it finds free page reporting from a virtio balloon's feature bits
(a sysfs tree laid out as the kernel lays it out) and waits only where the host takes memory back."""

from __future__ import annotations

import shutil
from pathlib import Path

from bench.memory_state import ReclaimedStart, free_page_reporting, reclaim_wait_s, tree_bytes


def _device(root: Path, name: str, driver: str, features: str) -> None:
    dev = root / "devices" / name
    dev.mkdir(parents=True)
    (root / "drivers" / driver).mkdir(parents=True, exist_ok=True)
    (dev / "driver").symlink_to(root / "drivers" / driver)
    (dev / "features").write_text(features + "\n")


def test_reporting_is_the_balloons_feature_bit_5(tmp_path: Path) -> None:
    _device(tmp_path, "virtio1", "virtio_blk", "0000011000")  # bit 5 set, but not a balloon
    assert not free_page_reporting(tmp_path / "devices")
    _device(tmp_path, "virtio0", "virtio_balloon", "0110000000")  # stats + deflate on OOM only
    assert not free_page_reporting(tmp_path / "devices")
    (tmp_path / "devices" / "virtio0" / "features").write_text("0110010000\n")
    assert free_page_reporting(tmp_path / "devices")
    assert not free_page_reporting(tmp_path / "missing")


def test_the_wait_grows_with_what_was_freed_and_is_zero_without_reporting() -> None:
    assert reclaim_wait_s(2 * 10**9, True) == 6.0
    assert reclaim_wait_s(4 * 10**9, True) == 10.0
    assert reclaim_wait_s(0, True) == 0.0
    assert reclaim_wait_s(4 * 10**9, False) == 0.0


def test_the_settle_step_frees_before_it_waits(tmp_path: Path) -> None:
    (tmp_path / "out" / "sub").mkdir(parents=True)
    (tmp_path / "out" / "sub" / "a").write_bytes(b"x" * 1000)
    (tmp_path / "b").write_bytes(b"y" * 234)
    assert tree_bytes([tmp_path / "out", tmp_path / "b", tmp_path / "gone"]) == 1234

    def clear() -> int:
        freed = tree_bytes([tmp_path / "out"])
        shutil.rmtree(tmp_path / "out")
        return freed

    start = ReclaimedStart(clear, reporting=False)
    start()
    assert not (tmp_path / "out").exists() and start.waited_s == 0.0

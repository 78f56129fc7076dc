"""The collector kept out of start-up imports: no collection during them, everything they made
frozen afterwards, the collector's state restored either way."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from pretrain.platform.import_collector import imports_without_collecting


@pytest.fixture
def collections() -> Iterator[list[int]]:
    """The generations collected while the test runs; the process's frozen objects given back."""
    seen: list[int] = []

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(record)
    try:
        yield seen
    finally:
        gc.callbacks.remove(record)
        gc.unfreeze()


def test_imports_run_without_a_collection_and_what_they_made_is_frozen(collections: list[int]) -> None:
    assert gc.isenabled()
    frozen_before = gc.get_freeze_count()
    with imports_without_collecting():
        made = [[i] for i in range(200_000)]  # as an import's objects: far past every threshold
        assert not gc.isenabled()
    assert collections == [], "the collector walked the heap while it grew"
    assert gc.isenabled(), "the process collects again afterwards"
    assert gc.get_freeze_count() >= frozen_before + len(made)
    more = [[i] for i in range(5_000)]  # what training makes afterwards is collected as before
    assert collections, "the collector no longer runs"
    del made, more


def test_a_failed_import_restores_the_collector_and_freezes_nothing(collections: list[int]) -> None:
    frozen_before = gc.get_freeze_count()
    with pytest.raises(ImportError), imports_without_collecting():
        raise ImportError("no module named 'missing'")
    assert gc.isenabled() and gc.get_freeze_count() == frozen_before


def test_a_process_whose_collector_was_off_keeps_it_off(collections: list[int]) -> None:
    gc.disable()
    try:
        with imports_without_collecting():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_pause_without_the_freeze_leaves_the_processes_garbage_collectable(collections: list[int]) -> None:
    """``freeze=False`` (a command's ``main`` that may run inside a longer-lived process): no
    collection during the body, nothing frozen after it, and a cycle left behind is still freed."""
    frozen_before = gc.get_freeze_count()
    with imports_without_collecting(freeze=False):
        made = [[i] for i in range(200_000)]
        cycle: list[object] = []
        cycle.append(cycle)
        assert not gc.isenabled()
        during = list(collections)  # (after the pause, the counts past every threshold collect at once)
    assert during == [] and gc.isenabled()
    assert gc.get_freeze_count() == frozen_before, "the pause froze the heap"
    del made, cycle
    assert gc.collect() >= 1, "the cycle made during the pause was not collectable"

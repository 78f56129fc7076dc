"""Megatron's writer results queue holds bytes: results cross from a forked writer to the rank
intact, and the Manager that serves the queue never imports torch."""

from __future__ import annotations

import multiprocessing
import queue
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from megatron.core.dist_checkpointing.strategies import filesystem_async
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from pretrain.platform.bytes_queue import BytesQueue
from pretrain.platform.compat import drain_write_results, reset_write_results_queue, warm_write_results_queue

RESULTS = {0: [WriteResult(index=MetadataIndex("model.w", (0, 0)), size_in_bytes=4096, storage_data="__0_0.distcp")]}


@pytest.fixture
def results_queue() -> Iterator[BytesQueue]:
    """The process's writer queue, new for the test; its Manager shut down afterwards."""
    before = filesystem_async._results_queue
    filesystem_async._results_queue = None
    warm_write_results_queue()
    made = filesystem_async._results_queue
    try:
        assert isinstance(made, BytesQueue)
        yield made
    finally:
        getattr(made, "inner", made)._manager.shutdown()  # the proxy's own Manager (started by the warm-up)
        reset_write_results_queue()
        filesystem_async._results_queue = before


def _writer(results: BytesQueue) -> None:
    results.put(RESULTS)  # what Megatron's forked writer does with its results


def _manager_libraries(results: BytesQueue) -> list[str]:
    manager = psutil.Process(results.inner._manager._process.pid)  # the Manager serving this queue
    return [m.path for m in manager.memory_maps()]


def test_a_forked_writers_results_reach_the_rank_and_the_manager_never_loads_torch(results_queue: BytesQueue) -> None:
    writer = multiprocessing.get_context("fork").Process(target=_writer, args=(results_queue,))
    writer.start()
    writer.join(60)
    assert writer.exitcode == 0
    assert results_queue.get(timeout=30) == RESULTS
    loaded = _manager_libraries(results_queue)
    assert not [p for p in loaded if "libtorch" in Path(p).name], "the Manager unpickled a result and imported torch"


def test_the_drain_empties_it_and_an_empty_queue_says_so(results_queue: BytesQueue) -> None:
    results_queue.put(RESULTS)
    results_queue.put_nowait({"stale": True})
    drain_write_results()
    with pytest.raises(queue.Empty):
        results_queue.get_nowait()
    assert results_queue.qsize() == 0  # what the queue itself answers


class _Unrebuildable(Exception):
    """An exception whose stored arguments do not rebuild it (pickling it works, loading it fails)."""

    def __init__(self, path: str, errno: int) -> None:
        super().__init__(f"{path}: errno {errno}")


def test_a_result_that_cannot_be_loaded_comes_back_as_the_writers_failure(results_queue: BytesQueue) -> None:
    results_queue.put(_Unrebuildable("/ckpt/__0_0.distcp", 28))
    got = results_queue.get(timeout=30)
    assert isinstance(got, RuntimeError) and "could not be read back" in str(got), got

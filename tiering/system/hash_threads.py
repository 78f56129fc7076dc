"""Process-wide hashing threads, started once and kept: no thread starts or exits per file.

Why kept: a thread that starts or exits holds CPython's runtime lock (``HEAD_LOCK``) for an
instant, and a process forked at that instant leaves its child deadlocked in the interpreter's
after-fork code, before any code of the child runs (CPython gh-112275; fixed in 3.12 and in 3.11
from 3.11.10, and this machine runs 3.11.7). The checkpoint writers fork: tier 1's copy-on-write
writer on CPU and Megatron's dist-checkpoint writer. Tier 0 hashed each snapshot on a thread pool
made for it, so threads started and exited every step, and about one fork in a hundred hung until
tier 1 declared its storage stalled, 60 s later. Threads that are kept wait on their queues and take
no such lock.

:class:`HashLanes` are ``n`` such threads, each serving its own queue in order (a chunk fed in
pieces stays on one lane, so its hasher sees its bytes in order). A forked child has none of its
parent's threads: the registry is emptied in the child and refilled on first use there.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

# Pieces queued per lane before a producer waits: bounds the bytes copied ahead of the hashers.
LANE_DEPTH = 64

_Job = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class HashLanes:
    """``n`` kept threads, each running the jobs of its own queue in the order they came."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._queues: list[queue.Queue[_Job]] = [queue.Queue(maxsize=LANE_DEPTH) for _ in range(n)]
        for i, q in enumerate(self._queues):
            threading.Thread(target=_serve, args=(q,), name=f"hash-lane-{n}-{i}", daemon=True).start()

    def submit(self, lane: int, fn: Callable[..., R], *args: Any) -> Future[R]:
        """Run ``fn(*args)`` on lane ``lane % n`` after everything queued there before it."""
        fut: Future[R] = Future()
        self._queues[lane % self.n].put((fut, fn, args))
        return fut

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """``fn`` over ``items`` spread over the lanes; the results in order (the first error raised)."""
        futures = [self.submit(i, fn, item) for i, item in enumerate(items)]
        return [f.result() for f in futures]

    def drain(self, lanes: Iterable[int]) -> None:
        """Wait until everything queued so far on ``lanes`` has run."""
        for f in [self.submit(lane, _nothing) for lane in lanes]:
            f.result()


def _nothing() -> None:
    return None


def _serve(q: queue.Queue[_Job]) -> None:
    while True:
        fut, fn, args = q.get()
        if not fut.set_running_or_notify_cancel():
            continue
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            fut.set_exception(exc)


_lanes: dict[int, HashLanes] = {}
_registry_lock = threading.Lock()


def hash_lanes(n: int) -> HashLanes:
    """The process's ``n``-lane hashing threads (started on first use, kept for the process)."""
    with _registry_lock:
        lanes = _lanes.get(n)
        if lanes is None:
            lanes = _lanes[n] = HashLanes(n)
        return lanes


def _forget_in_child() -> None:
    global _registry_lock
    _lanes.clear()  # their threads did not come along
    _registry_lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_forget_in_child)

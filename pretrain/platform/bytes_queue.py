"""Megatron's checkpoint-writer results queue, made to hold pickled bytes in its Manager.

Megatron's async file writer hands each save's ``WriteResult`` lists back to the rank through a
queue served by a spawned multiprocessing Manager, one per rank process. A Manager's queue stores
the objects themselves, so its server unpickles every result, and unpickling a ``WriteResult``
imports ``torch.distributed.checkpoint.storage``, which imports torch: measured on this project's
2-core CPU host, each rank's Manager burned 2.9-3.1 s of CPU at the first save of every attempt
(and kept torch's hundreds of megabytes resident), and the steps after that save ran 2-4x slower
until it was done. :class:`BytesQueue` pickles on ``put`` and unpickles on ``get``, so the Manager
only ever holds ``bytes`` and never imports anything.

The pickles are the rank's own: its forked writer's results, through a Manager that only this
process tree can reach (its authkey), as they were before; nothing here reads a shared file.
Owns the wrapping only; :func:`pretrain.platform.compat.warm_write_results_queue` installs it.
"""

from __future__ import annotations

import pickle
from typing import Any, Protocol


class ItemQueue(Protocol):
    """What Megatron calls on its results queue (a Manager's ``Queue`` proxy)."""

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None: ...

    def get(self, block: bool = True, timeout: float | None = None) -> Any: ...


class BytesQueue:
    """A queue of any picklable objects that stores each one as its pickle in ``inner``."""

    def __init__(self, inner: ItemQueue) -> None:
        self._inner = inner

    @property
    def inner(self) -> ItemQueue:
        return self._inner

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        self._inner.put(pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL), block, timeout)

    def put_nowait(self, item: Any) -> None:
        self.put(item, block=False)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """The next item; one whose pickle cannot be loaded here (an exception class whose
        arguments do not rebuild it, say) comes back as a ``RuntimeError`` naming why, which
        Megatron's reader takes as its writer's failure (before, the Manager's own unpickling
        failed the writer's ``put``)."""
        data = self._inner.get(block, timeout)
        try:
            return pickle.loads(data)  # noqa: S301 - this rank's own writer's results
        except Exception as exc:  # noqa: BLE001 - handed back as the failed write it is, never dropped
            return RuntimeError(f"a checkpoint writer's result could not be read back: {type(exc).__name__}: {exc}")

    def get_nowait(self) -> Any:
        return self.get(block=False)

    def __getattr__(self, name: str) -> Any:
        """``qsize``, ``empty`` and the like, as the inner queue answers them."""
        # _inner: looked up before __init__ ran (unpickling). Special names (copy's __deepcopy__,
        # pickle's hooks) must not answer for the inner queue: a copy would lose the wrapper.
        if name == "_inner" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._inner, name)

"""The few collective operations the publish protocol needs, behind one small Protocol.

The trainer passes :class:`TorchCollective` (torch.distributed, any backend); the CLI and unit
tests use :class:`SingleProcess`. Keeping this seam narrow lets tiers be tested without a
process group and lets other frameworks reuse the protocol.
"""

from __future__ import annotations

from typing import Any, Protocol


class Collective(Protocol):
    rank: int
    world_size: int

    def barrier(self) -> None: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def all_gather(self, obj: Any) -> list[Any]: ...

    def all_true(self, flag: bool) -> bool: ...

    def min_int(self, value: int) -> int: ...


class SingleProcess:
    rank = 0
    world_size = 1

    def barrier(self) -> None:
        return None

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def all_true(self, flag: bool) -> bool:
        return bool(flag)

    def min_int(self, value: int) -> int:
        return value


class TorchCollective:
    """Collectives over a torch.distributed group: the default group unless one is given (the rank
    program passes a gloo group beside NCCL: object collectives on NCCL cost device syncs)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist  # deferred: the tiering CLI and S3 paths run without torch

        self._dist = dist
        self._group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def barrier(self) -> None:
        self._dist.barrier(group=self._group)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=src, group=self._group)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self._group)
        return out

    def all_true(self, flag: bool) -> bool:
        return all(self.all_gather(bool(flag)))

    def min_int(self, value: int) -> int:
        return min(self.all_gather(int(value)))

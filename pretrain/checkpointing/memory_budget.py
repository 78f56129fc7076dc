"""What tier 0 needs of a node's memory, and the limit that really applies there.

Owns the arithmetic of tier 0's budget per node, plus the two things it reads to get there: the
optimizer's moments a first step will still create (:func:`missing_moment_bytes`) and the job's
cgroup memory headroom (:func:`cgroup_free_bytes`, v2 and v1 paths), and the per-node host memory by
tier that ``pretrain plan`` prints and :func:`pretrain.train.train` checks at start
(:func:`host_memory_per_node`, :func:`host_memory_refusal`). It never imports torch, never writes, never
refuses anything itself and never talks to another rank: :meth:`MemoryTier.check_capacity`
gathers each rank's :class:`RankNeed` and the node's :class:`NodeRoom`, and refuses with
:meth:`Budget.refusal`'s line.

What counts (issue 45 #9):

* a rank's own state as it will be after its first step: on GPU the inner optimizer (TE FusedAdam
  or torch AdamW under Megatron's DistributedOptimizer) creates ``exp_avg``/``exp_avg_sq`` lazily,
  so a state sized before the first step lacks 2/3 of the optimizer shard;
* ``slots x (own + peer)`` in the tmpfs, for every rank of the node that shares it;
* on CUDA, host memory outside the tmpfs: the pinned arenas tier 0 and tier 1 copy a snapshot into
  (one per dtype, held for the process's life), each as torch's caching host allocator really
  allocates it: rounded up to a power of two (:func:`pinned_bytes`);
* NCCL's and PyTorch's own ``/dev/shm`` use when tier 0 lives in ``/dev/shm`` (reserved per rank);
* the limit: the tmpfs's free space plus what tier 0 already holds there, and the cgroup's
  ``memory.max - memory.current`` (tmpfs pages are charged to the job's cgroup: going over is an
  OOM kill, not ENOSPC).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
MOMENT_BYTES = 4  # fp32 moments (TE FusedAdam's and torch AdamW's default)
# NCCL's shared-memory segments (proxy and SHM transport buffers) and PyTorch's, per rank, when
# tier 0 shares /dev/shm with them: an allowance, not a measurement (NCCL_BUFFSIZE 4 MiB x
# channels x peers stays well below it on an 8-GPU node).
SHM_RESERVE_PER_RANK = 1 << 30


def power_of_two_ceil(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def pinned_bytes(arenas: Iterable[int]) -> int:
    """Host memory that pinned arenas of these byte sizes take: PyTorch's CachingHostAllocator
    (``aten/src/ATen/core/CachingHostAllocator.h``, ``allocate``) rounds every request up to
    ``PowerOf2Ceil(size)`` unless it is above ``pinned_max_round_threshold`` (unset by default, so
    always; torch 2.13 read), and the whole block stays locked. At 70B TP8 PP4 DP16 a rank's bf16
    and fp32 arenas (0.28 and 1.70 GB) take 0.54 and 2.15 GB: +35 %."""
    return sum(power_of_two_ceil(b) for b in arenas)


def _inner_optimizers(optimizer: Any) -> Iterable[Any]:
    """The torch optimizers under Megatron's wrappers (chained, distributed) or the optimizer itself."""
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        # Megatron's optimizers keep the torch one as .optimizer, the CPU path's CpuAdamW as .opt
        yield getattr(opt, "optimizer", None) or getattr(opt, "opt", None) or opt


def missing_moment_bytes(optimizer: Any) -> int:
    """Bytes of the Adam moments a first ``step()`` will create (0 once every parameter has them)."""
    missing = 0
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                have = inner.state.get(p, {})
                missing += sum(p.numel() * MOMENT_BYTES for key in ADAM_MOMENTS if key not in have)
    return missing


def _cgroup_limit_usage(root: Path) -> tuple[int, int] | None:
    """(limit, usage) of this process's memory cgroup (v2 ``memory.max``/``memory.current``, else v1
    ``memory.limit_in_bytes``/``memory.usage_in_bytes``); None without a limit or a readable cgroup."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if hid == "0" and controllers == "":
            base, files = root / "sys/fs/cgroup" / rel, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base, files = root / "sys/fs/cgroup/memory" / rel, ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        if not base.is_dir():  # a container's own cgroup mounted at the root, without a namespace
            base = base.parents[len(Path(rel).parts) - 1] if rel else base
        try:
            limit, usage = ((base / f).read_text().strip() for f in files)
        except OSError:
            continue
        if limit == "max" or int(limit) >= 1 << 60:  # v1 writes "no limit" as a page-rounded 2^63
            return None
        return int(limit), int(usage)
    return None


def cgroup_free_bytes(root: Path = Path("/")) -> int | None:
    """``limit - usage`` of this process's memory cgroup; None without a limit."""
    got = _cgroup_limit_usage(root)
    return None if got is None else max(0, got[0] - got[1])


@dataclass(frozen=True)
class RankNeed:
    own_bytes: int  # this rank's tier-0 payload after its first step
    peer_bytes: int = 0  # the states of the ranks whose copies it holds (each after its first step)
    transient_bytes: int = 0  # host memory a write takes while it runs
    pinned_bytes: int = 0  # pinned snapshot arenas held for life (CUDA only)


@dataclass(frozen=True)
class NodeRoom:
    tmpfs_free_bytes: int
    tier0_held_bytes: int = 0  # already in the tmpfs (and in the cgroup): replaced as slots rotate
    cgroup_free_bytes: int | None = None  # None: no cgroup limit
    shm_reserve_bytes: int = 0  # NCCL's and PyTorch's /dev/shm use when tier 0 shares it


@dataclass(frozen=True)
class Budget:
    ranks: int
    slots: int
    biggest: RankNeed
    tmpfs_need: int  # slots x (own + peer) for every rank, plus the /dev/shm reserve
    memory_need: int  # what the cgroup must still give: tmpfs growth plus transient and pinned
    tmpfs_room: int
    memory_room: int | None
    shm_reserve: int = 0

    def refusal(self, source: str, where: str) -> str | None:
        """One line (sizes and fix) when the node cannot hold it, else None."""
        b = self.biggest
        own_peer = f"own {_gib(b.own_bytes)} + peer {_gib(b.peer_bytes)}"
        shape = f"{self.ranks} rank(s) on this node need {self.slots} slots x ({own_peer})"
        if self.tmpfs_need > self.tmpfs_room:
            shm = f" + {_gib(self.shm_reserve)} NCCL /dev/shm" if self.shm_reserve else ""
            return (
                f"{source}: checkpoint.memory.dir {where} has {_gib(self.tmpfs_room)} free for tier 0, but {shape}"
                f"{shm} = {_gib(self.tmpfs_need)}; fix: give the container at least {_gib(self.tmpfs_need)} of "
                "shared memory (docker run --shm-size, Kubernetes emptyDir {medium: Memory, sizeLimit}) or set "
                "checkpoint.memory.enabled=false"
            )
        if self.memory_room is not None and self.memory_need > self.memory_room:
            return (
                f"{source}: the job's memory cgroup has {_gib(self.memory_room)} left, but tier 0 in {where} needs "
                f"{_gib(self.memory_need)} more ({shape}, plus {_gib(b.transient_bytes)} transient and "
                f"{_gib(b.pinned_bytes)} pinned per rank; tmpfs pages count against the cgroup: an OOM kill, not "
                "ENOSPC); fix: raise the job's memory limit (Kubernetes resources.limits.memory, Slurm --mem) by "
                f"{_gib(self.memory_need - self.memory_room)}, lower checkpoint.memory.slots, or set "
                "checkpoint.memory.enabled=false"
            )
        return None


def node_budget(ranks: list[RankNeed], slots: int, room: NodeRoom) -> Budget:
    """Tier 0's need on one node (the ranks sharing its tmpfs) against the room that really applies."""
    tmpfs = sum(slots * (r.own_bytes + r.peer_bytes) for r in ranks) + room.shm_reserve_bytes
    host = sum(r.transient_bytes + r.pinned_bytes for r in ranks)
    return Budget(
        ranks=len(ranks),
        slots=slots,
        biggest=max(ranks, key=lambda r: r.own_bytes + r.peer_bytes),
        tmpfs_need=tmpfs,
        memory_need=max(0, tmpfs - room.tier0_held_bytes) + host,
        tmpfs_room=room.tmpfs_free_bytes + room.tier0_held_bytes,
        memory_room=room.cgroup_free_bytes,
        shm_reserve=room.shm_reserve_bytes,
    )


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


# Per-node host memory by tier (``pretrain plan`` and the start-up refusal), from the layout alone.
SLOT_SLACK = 4 * 1024 * 1024  # pickle framing per slot (as PAYLOAD_SLACK_BYTES)
RESHARDABLE_BYTES_PER_PARAM = 20  # fully reshardable DistOpt gather: 3 fp32 world tensors + copies (~44 GB for 2.2e9)
RANK_RSS_BYTES = 10 * 10**9  # a GPU rank's own RSS (torch, Megatron, NCCL, data) beside its checkpoints
SERVER_RSS_BYTES = 10 * 10**9  # the standby server (one per node)


@dataclass(frozen=True)
class Layout:
    """What ``pretrain plan``'s model derives from a config (per rank) and the tiers it turns on."""

    params_per_rank: int
    weight_bytes: int  # per parameter (bf16: 2)
    state_bytes_per_rank: int
    ranks_per_node: int
    tier0_slots: int  # 0: tier 0 off
    peer_copies: int
    tier1_background: bool  # pinned snapshot buffers (GPU thread writer)
    reshardable_gather: bool  # the fully reshardable DistributedOptimizer save/load
    gpu: bool
    arena_bytes: tuple[int, ...] = ()  # a rank's state by dtype (one pinned arena each); () = one of the state

    def pinned_arena_bytes(self) -> int:
        """One pinned arena set (tier 0's or tier 1's) of one rank, as allocated (power-of-two rounded)."""
        return pinned_bytes(self.arena_bytes or (self.state_bytes_per_rank,))


def host_memory_per_node(x: Layout) -> list[tuple[str, int]]:
    """(what, bytes) per node for each consumer of host memory, the last row their total."""
    n = x.ranks_per_node
    rows = [
        (
            f"tier 0 tmpfs: {x.tier0_slots} slots x (own + {x.peer_copies} peer)" if x.tier0_slots else "tier 0 (off)",
            x.tier0_slots * (1 + x.peer_copies) * (x.state_bytes_per_rank + SLOT_SLACK) * n,
        ),
        ("tier 0 pinned arena (its GPU copy)", x.pinned_arena_bytes() * n if x.tier0_slots and x.gpu else 0),
        ("tier 1 pinned arena", x.pinned_arena_bytes() * n if x.tier1_background and x.gpu else 0),
        (
            "fully reshardable save/load peak",
            RESHARDABLE_BYTES_PER_PARAM * x.params_per_rank * n if x.reshardable_gather else 0,
        ),
        ("ranks' own RSS and the standby server", (RANK_RSS_BYTES * n + SERVER_RSS_BYTES) if x.gpu else 0),
    ]
    return [*rows, ("total", sum(b for _, b in rows))]


def node_memory_bytes(root: Path = Path("/")) -> int | None:
    """What this node (or job cgroup) may hold: MemTotal, or the cgroup's limit when smaller."""
    try:
        meminfo = (root / "proc/meminfo").read_text()
    except OSError:
        return None
    total = next((int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemTotal:")), None)
    limit = _cgroup_limit_usage(root)
    if limit is not None and (total is None or limit[0] < total):
        return limit[0]
    return total


def host_memory_refusal(source: str, rows: list[tuple[str, int]], have: int) -> str | None:
    """One line naming every size when the node has less memory than the rows' total."""
    need = rows[-1][1]
    if need <= have:
        return None
    parts = ", ".join(f"{what} {_gib(b)}" for what, b in rows[:-1] if b)
    return (
        f"{source}: this node has {_gib(have)} of memory, but the run needs {_gib(need)} per node ({parts}); fix: run "
        "on nodes with more memory, more nodes (a smaller state per rank), checkpoint.memory.slots lower or "
        "checkpoint.memory.enabled=false"
    )

"""Tier 0's memory budget per node (issue 45 #9): what a rank needs after its first step, the host
memory a write takes on CUDA, NCCL's /dev/shm, and the limit that applies (tmpfs free space, the
cgroup's headroom, v2 and v1). Pure arithmetic table-driven; the readers on real files and a real
torch optimizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pretrain.checkpointing.memory_budget import (
    NodeRoom,
    RankNeed,
    cgroup_free_bytes,
    largest_storage_bytes,
    missing_moment_bytes,
    node_budget,
)
from pretrain.config.training import OptimizerConfig
from pretrain.optim import CpuAdamW

GIB = 1 << 30


def test_a_first_step_creates_two_fp32_moments_per_parameter_then_nothing_is_missing() -> None:
    params = [torch.nn.Parameter(torch.zeros(1000)), torch.nn.Parameter(torch.zeros(10, 30))]
    opt = torch.optim.AdamW(params, lr=0.1)
    assert missing_moment_bytes(opt) == 2 * 4 * (1000 + 300)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert missing_moment_bytes(opt) == 0


def test_moments_are_counted_through_megatron_style_wrappers() -> None:
    class Distributed:  # Megatron's DistributedOptimizer keeps the torch optimizer as .optimizer
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self.optimizer = inner

    class Chained:
        def __init__(self, *opts: object) -> None:
            self.chained_optimizers = list(opts)

    a = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(100))])
    b = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(50))])
    assert missing_moment_bytes(Chained(Distributed(a), Distributed(b))) == 2 * 4 * 150


def test_the_largest_storage_is_what_one_host_copy_holds() -> None:
    buffer = torch.zeros(4096)
    payload = {"model": {"w": buffer[:10], "b": torch.zeros(3)}, "opt": [torch.zeros(100, dtype=torch.float64)]}
    assert largest_storage_bytes(payload) == 4096 * 4  # a view holds its whole storage


# (ranks, slots, room, refused_by, tmpfs_need_gib, memory_need_gib)
CASES = [
    # fits: 2 ranks x 2 slots x (3 + 3) = 24 GiB in 30 free, no cgroup limit
    ([RankNeed(3 * GIB, 3 * GIB)] * 2, 2, NodeRoom(30 * GIB), None, 24, 24),
    # tmpfs too small
    ([RankNeed(3 * GIB, 3 * GIB)] * 2, 2, NodeRoom(20 * GIB), "shared memory", 24, 24),
    # what tier 0 already holds counts as room (its slots are rewritten in place)
    ([RankNeed(3 * GIB, 3 * GIB)] * 2, 2, NodeRoom(20 * GIB, tier0_held_bytes=6 * GIB), None, 24, 18),
    # the tmpfs has room, the cgroup does not: tmpfs pages are charged to it
    ([RankNeed(3 * GIB, 3 * GIB)] * 2, 2, NodeRoom(30 * GIB, cgroup_free_bytes=20 * GIB), "memory cgroup", 24, 24),
    # CUDA host memory outside the tmpfs: transient 1 + pinned 3 per rank, counted against the cgroup only
    (
        [RankNeed(3 * GIB, 3 * GIB, GIB, 3 * GIB)] * 2,
        2,
        NodeRoom(30 * GIB, cgroup_free_bytes=30 * GIB),
        "memory cgroup",
        24,
        32,
    ),
    ([RankNeed(3 * GIB, 3 * GIB, GIB, 3 * GIB)] * 2, 2, NodeRoom(30 * GIB, cgroup_free_bytes=33 * GIB), None, 24, 32),
    # NCCL's /dev/shm reserve tips a tmpfs that held the state alone
    ([RankNeed(3 * GIB, 3 * GIB)] * 2, 2, NodeRoom(25 * GIB, shm_reserve_bytes=2 * GIB), "NCCL /dev/shm", 26, 26),
]


@pytest.mark.parametrize(("ranks", "slots", "room", "refused_by", "tmpfs_gib", "memory_gib"), CASES)
def test_node_budget(
    ranks: list[RankNeed], slots: int, room: NodeRoom, refused_by: str | None, tmpfs_gib: int, memory_gib: int
) -> None:
    budget = node_budget(ranks, slots, room)
    assert (budget.tmpfs_need, budget.memory_need) == (tmpfs_gib * GIB, memory_gib * GIB)
    line = budget.refusal("configs/x.yaml", "/dev/shm/t0")
    if refused_by is None:
        assert line is None
    else:
        assert line is not None and refused_by in line and "\n" not in line
        assert (
            line.startswith("configs/x.yaml: ")
            and "fix:" in line
            and "2 slots x (own 3.00 GiB + peer 3.00 GiB)" in line
        )


def _cgroup_root(tmp_path: Path, proc_line: str, files: dict[str, str]) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(proc_line)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("proc_line", "files", "free"),
    [
        (
            "0::/job.slice/step_0\n",
            {
                "sys/fs/cgroup/job.slice/step_0/memory.max": "1000\n",
                "sys/fs/cgroup/job.slice/step_0/memory.current": "400\n",
            },
            600,
        ),
        (
            "0::/job.slice/step_0\n",
            {
                "sys/fs/cgroup/job.slice/step_0/memory.max": "max\n",
                "sys/fs/cgroup/job.slice/step_0/memory.current": "400\n",
            },
            None,
        ),
        (
            "5:cpu:/\n4:memory:/kubepods/pod1\n",
            {
                "sys/fs/cgroup/memory/kubepods/pod1/memory.limit_in_bytes": "2000\n",
                "sys/fs/cgroup/memory/kubepods/pod1/memory.usage_in_bytes": "500\n",
            },
            1500,
        ),
        (
            "4:memory:/kubepods/pod1\n",
            {
                "sys/fs/cgroup/memory/kubepods/pod1/memory.limit_in_bytes": "9223372036854771712\n",
                "sys/fs/cgroup/memory/kubepods/pod1/memory.usage_in_bytes": "500\n",
            },
            None,
        ),
        # the container's own cgroup mounted at the hierarchy's root (no cgroup namespace)
        (
            "4:memory:/docker/abc\n",
            {
                "sys/fs/cgroup/memory/memory.limit_in_bytes": "3000\n",
                "sys/fs/cgroup/memory/memory.usage_in_bytes": "1000\n",
            },
            2000,
        ),
        ("5:cpu:/\n", {}, None),  # no memory controller
        ("4:memory:/gone\n", {}, None),  # unreadable
    ],
)
def test_cgroup_headroom_is_read_from_v2_or_v1(
    tmp_path: Path, proc_line: str, files: dict[str, str], free: int | None
) -> None:
    assert cgroup_free_bytes(_cgroup_root(tmp_path, proc_line, files)) == free


def test_the_cpu_optimizer_materialises_its_moments_so_nothing_is_missing() -> None:
    opt = CpuAdamW(OptimizerConfig(), torch.nn.Linear(8, 4))
    assert missing_moment_bytes(opt) == 0
    assert missing_moment_bytes(opt.opt) == 0

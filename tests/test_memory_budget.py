"""Tier 0's memory budget per node (issue 45 #9): what a rank needs after its first step, the host
memory a write takes on CUDA, NCCL's /dev/shm, and the limit that applies (tmpfs free space, the
cgroup's headroom, v2 and v1). Pure arithmetic table-driven; the readers on real files and a real
torch optimizer."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from pretrain.checkpointing.memory_budget import (
    NodeRoom,
    RankNeed,
    cgroup_free_bytes,
    host_memory_per_node,
    missing_moment_bytes,
    node_budget,
    node_memory_bytes,
    pinned_bytes,
    power_of_two_ceil,
)
from pretrain.commands.plan_model import host_layout, model_size
from pretrain.config import load_config
from pretrain.config.training import OptimizerConfig
from pretrain.errors import ConfigError
from pretrain.optim import CpuAdamW
from pretrain.train import _check_host_memory
from tests.helpers import PYTHON, REPO, TINY

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


def test_the_node_memory_is_the_smaller_of_memtotal_and_the_cgroup_limit(tmp_path: Path) -> None:
    root = _cgroup_root(
        tmp_path,
        "0::/job\n",
        {
            "proc/meminfo": "MemTotal:       4000 kB\nMemFree: 1 kB\n",
            "sys/fs/cgroup/job/memory.max": "1024000\n",
            "sys/fs/cgroup/job/memory.current": "0\n",
        },
    )
    assert node_memory_bytes(root) == 1024000
    (root / "sys/fs/cgroup/job/memory.max").write_text("max\n")
    assert node_memory_bytes(root) == 4000 * 1024


def test_the_70b_host_memory_per_node_by_tier() -> None:
    """TP8 PP4 DP16, 8 ranks a node: the review's reading was ~820 GB with 3 tier-0 slots, when every
    DP rank saved the whole weights; each saves 1/16 of them now (dp_slices): ~580 GB."""
    cfg = load_config(REPO / "configs" / "gpt-70b-h100.yaml")
    size = model_size(cfg, 64 * 8)
    rows = dict(host_memory_per_node(host_layout(cfg, size, 8, gpu=True)))
    state, n = size.state_bytes_per_rank, size.params_per_rank
    assert rows["tier 0 tmpfs: 3 slots x (own + 1 peer)"] == 3 * 2 * (state + (4 << 20)) * 8
    weights, optimizer = size.arena_bytes()  # one pinned arena per dtype: bf16 weights, fp32 optimizer
    assert (weights, optimizer) == (-(-n * 2 // 16), -(-n * 12 // 16))
    arena = power_of_two_ceil(weights) + power_of_two_ceil(optimizer)  # as torch's caching host allocator allocates
    assert rows["tier 0 pinned arena (its GPU copy)"] == rows["tier 1 pinned arena"] == arena * 8
    assert 1.3 < arena / state < 1.4, arena / state  # the exact size understated it by a third
    assert rows["fully reshardable save/load peak"] == 20 * n * 8
    assert rows["total"] == sum(v for k, v in rows.items() if k != "total")
    assert state == -(-n * 2 // 16) + -(-n * 12 // 16)  # bf16 weights and fp32 master + Adam m, v: 1/dp each
    assert 570e9 < rows["total"] < 620e9


@pytest.mark.parametrize(
    ("config", "nodes", "tier0"),
    [("gpt-8b-h100.yaml", 8, "tier 0 tmpfs: 2 slots"), ("gpt-70b-h100.yaml", 64, "tier 0 tmpfs: 3 slots")],
)
def test_pretrain_plan_prints_host_memory_per_node_by_tier(config: str, nodes: int, tier0: str) -> None:
    out = subprocess.run(
        [
            PYTHON,
            "-m",
            "pretrain",
            "plan",
            "--config",
            f"configs/{config}",
            "--nodes",
            str(nodes),
            "--ranks-per-node",
            "8",
            "--mtbf-hours",
            "3",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    ).stdout
    block = out.split("host memory per node (8 ranks; refused at start where the node has less):\n")[1].splitlines()
    assert block[0].strip().startswith(tier0)
    names = [line.strip().rsplit("  ", 1)[0].strip() for line in block[:6]]
    assert names[1:] == [
        "tier 0 pinned arena (its GPU copy)",
        "tier 1 pinned arena",
        "fully reshardable save/load peak",
        "ranks' own RSS and the standby server",
        "total",
    ]
    assert block[5].strip().endswith("GB")


def test_a_node_with_less_memory_than_the_run_needs_is_refused_at_start_in_one_line() -> None:
    have = node_memory_bytes()
    assert have is not None
    with pytest.raises(ConfigError) as err:  # 70B on 32 ranks: ~220 GiB a node for tier 0 alone
        _check_host_memory(load_config(REPO / "configs" / "gpt-70b-h100.yaml"), 32, False)
    line = str(err.value)
    assert line.startswith(
        f"{REPO / 'configs' / 'gpt-70b-h100.yaml'}: this node has {have / (1 << 30):.2f} GiB of memory, but "
    )
    assert "tier 0 tmpfs: 3 slots x (own + 1 peer)" in line and "fix:" in line and "\n" not in line
    _check_host_memory(load_config(TINY), 1, False)  # the tiny run fits


@pytest.mark.parametrize(
    ("sizes", "pinned"),
    [((), 0), ((0,), 0), ((1,), 1), ((4096,), 4096), ((4097,), 8192), ((3 << 30,), 4 << 30), ((5, 9), 8 + 16)],
)
def test_pinned_arenas_count_as_torch_allocates_them_rounded_to_a_power_of_two(
    sizes: tuple[int, ...], pinned: int
) -> None:
    assert pinned_bytes(sizes) == pinned


def test_the_installed_torch_rounds_pinned_requests_to_a_power_of_two() -> None:
    """The rule pinned_bytes counts, read from the installed torch's CachingHostAllocator: every
    request rounded by PowerOf2Ceil unless above pinned_max_round_threshold, which defaults to no
    limit. A torch that changes this makes the plan's figure wrong: this fails first."""
    include = Path(torch.__file__).parent / "include"
    host = (include / "ATen" / "core" / "CachingHostAllocator.h").read_text()
    assert "return c10::llvm::PowerOf2Ceil(size);" in host and "size <= pinned_max_round_threshold()" in host
    config = (include / "c10" / "core" / "AllocatorConfig.h").read_text()
    assert "size_t pinned_max_round_threshold_{std::numeric_limits<size_t>::max()};" in config

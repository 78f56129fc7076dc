"""``pretrain plan``: checkpoint intervals, projected goodput and storage capacity.

Intervals: Young's first-order optimum ``sqrt(2 * delta * M)`` and Daly's higher-order one
``sqrt(2 delta M) * (1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9) - delta`` (``M`` if
``delta >= 2M``), where ``delta`` is what one save costs training (the blocked time, not the
background write) and ``M`` the job's mean time between failures.

Goodput (first order): each interval pays ``delta``; each failure loses on average half an
interval of work plus the restart cost ``R`` (detection, restart, restore, warm-up):
``goodput = 1 - delta / tau - (R + tau / 2) / M``.

Capacity: a full checkpoint holds, per parameter, the bf16 weights (2 B), the fp32 master copy
(4 B) and Adam's two moments (4 B + 4 B) = 14 B. Tier 1 keeps ``keep`` steps per node, times the
replication factor (own shards plus the replicas it holds); every estimate grows by the
``headroom`` fraction (``--headroom``, default 0.25).

Tier 0 (``checkpoint.memory``): each rank's state in ``slots`` tmpfs slots, plus the copies it holds
for its peers (``peer`` per slot, issue 29 part 3), so a node needs ``slots x (own + peer) x state
per rank x ranks per node`` of RAM, each slot counted as the state plus the 4 MiB the start-up check adds for a
payload's non-tensor values (``SLOT_SLACK_BYTES``), rounded up to the ``emptyDir`` ``sizeLimit``
the Kubernetes manifests carry (``size_limit``). Its interval is the fewest steps whose saves keep the total
cost (one save's step excess per interval) within ``budget`` of the step time (default 2 %):
``interval = ceil(save_cost / (budget x step_s))``. A failure then loses at most ``interval`` steps.

Fleet figures: the example MTBF, 466 job interruptions in 54 days of pre-training on 16,384 H100
GPUs, is Meta's record in "The Llama 3 Herd of Models" (Llama Team, AI @ Meta, 2024,
arXiv:2407.21783, section 3.3.4: 419 of them unexpected).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

BYTES_PER_PARAM = {"bf16_weights": 2, "fp32_master": 4, "adam_m": 4, "adam_v": 4}
# The start-up check's allowance per slot beyond the tensors (pretrain/checkpointing/memory_tier.py's
# PAYLOAD_SLACK_BYTES; not imported: that module needs torch, the plan must answer at once).
SLOT_SLACK_BYTES = 4 * 1024 * 1024
PER_PARAM_WORDS = {14: "bf16 weights + fp32 master + Adam m, v", 12: "fp32 weights + Adam m, v"}


def mtbf_from_failures(failures: int, days: float, cluster_gpus: int, job_gpus: int) -> float:
    """Job MTBF (s) from a fleet's record, e.g. Llama 3's 466 interruptions in 54 days on 16,384 GPUs:
    failures scale with the GPUs a job uses, so a job on ``job_gpus`` sees ``failures * job_gpus / cluster_gpus``."""
    if failures <= 0 or days <= 0 or cluster_gpus <= 0 or job_gpus <= 0:
        raise ValueError("failures, days and GPU counts must be positive")
    return days * 86400.0 * cluster_gpus / (failures * job_gpus)


def young_interval(save_s: float, mtbf_s: float) -> float:
    return math.sqrt(2.0 * save_s * mtbf_s)


def daly_interval(save_s: float, mtbf_s: float) -> float:
    if save_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = save_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * save_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - save_s


def goodput(interval_s: float, save_s: float, restart_s: float, mtbf_s: float) -> float:
    return max(0.0, 1.0 - save_s / interval_s - (restart_s + interval_s / 2.0) / mtbf_s)


@dataclass
class TierPlan:
    tier: str
    save_seconds: float
    restore_seconds: float
    young_interval_s: float
    daly_interval_s: float
    interval_steps: int | None
    goodput: float


@dataclass
class CapacityPlan:
    params: float
    bytes_per_param: int
    checkpoint_bytes: float
    per_node_tier1_bytes: float
    staging_bytes: float
    s3_bytes: float
    headroom: float


def plan_tier(
    tier: str, save_s: float, restore_s: float, mtbf_s: float, step_s: float | None, detect_restart_s: float
) -> TierPlan:
    if save_s <= 0 or mtbf_s <= 0:
        raise ValueError(f"tier {tier}: save cost and MTBF must be positive; fix: pass measured seconds > 0")
    tau = daly_interval(save_s, mtbf_s)
    steps = max(1, round(tau / step_s)) if step_s else None
    return TierPlan(
        tier,
        save_s,
        restore_s,
        young_interval(save_s, mtbf_s),
        tau,
        steps,
        goodput(tau, save_s, detect_restart_s + restore_s, mtbf_s),
    )


def plan_capacity(
    params: float,
    nodes: int,
    local_keep: int,
    replication_factor: int,
    staging_keep: int,
    s3_keep: int,
    headroom: float,
    per_param: int | None = None,
    tier1_bytes_per_node: float | None = None,
) -> CapacityPlan:
    """``per_param``: bytes per parameter of a full checkpoint (default 14); ``tier1_bytes_per_node``:
    the node's ranks' per-rank states (``pretrain plan --config``: data-parallel ranks each save
    their weights), else the checkpoint divided over the nodes."""
    if params <= 0 or nodes <= 0:
        raise ValueError("params and nodes must be positive")
    per_param = per_param or sum(BYTES_PER_PARAM.values())
    ckpt = params * per_param
    grow = 1.0 + headroom
    node_state = tier1_bytes_per_node if tier1_bytes_per_node is not None else ckpt / nodes
    return CapacityPlan(
        params,
        per_param,
        ckpt,
        node_state * local_keep * replication_factor * grow,
        ckpt * staging_keep * grow,
        ckpt * s3_keep * grow,
        headroom,
    )


@dataclass
class MemoryTierPlan:
    """Tier 0 on one node: the RAM its slots need and the interval its measured cost allows."""

    state_bytes_per_rank: float
    ranks_per_node: int
    slots: int
    peer_copies: int  # slots held for peers per own slot (0: no peer copy)
    ram_per_node_bytes: float
    save_seconds: float | None
    step_seconds: float | None
    budget: float
    interval_steps: int | None
    cost_fraction: float | None  # of the step time, at interval_steps

    @property
    def size_limit(self) -> str:
        return size_limit(self.ram_per_node_bytes)


def plan_memory_tier(
    state_bytes_per_rank: float,
    ranks_per_node: int,
    slots: int,
    peer_copies: int,
    save_s: float | None,
    step_s: float | None,
    budget: float = 0.02,
) -> MemoryTierPlan:
    if state_bytes_per_rank <= 0 or ranks_per_node <= 0 or slots < 1 or peer_copies < 0 or not 0 < budget < 1:
        raise ValueError(
            "tier 0: state bytes, ranks per node and slots must be positive, budget in (0, 1); "
            "fix: e.g. --ranks-per-node 8 --budget 0.02"
        )
    ram = slots * (1 + peer_copies) * (state_bytes_per_rank + SLOT_SLACK_BYTES) * ranks_per_node
    interval = fraction = None
    if save_s is not None and step_s:
        interval = max(1, math.ceil(save_s / (budget * step_s) - 1e-9))
        fraction = save_s / (interval * step_s)
    return MemoryTierPlan(
        state_bytes_per_rank, ranks_per_node, slots, peer_copies, ram, save_s, step_s, budget, interval, fraction
    )


def size_limit(n: float) -> str:
    """A Kubernetes quantity holding ``n`` bytes: whole MiB below 1 GiB, else whole GiB (rounded up)."""
    if n < 2**30:
        return f"{math.ceil(n / 2**20)}Mi"
    return f"{math.ceil(n / 2**30)}Gi"


def size_text(n: float) -> str:
    """Bytes as GB or MB (decimal), the way the plan prints them."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def format_memory_tier(m: MemoryTierPlan) -> list[str]:
    lines = [
        f"tier 0 (memory): RAM per node = {m.slots} slots x (own + {m.peer_copies} peer) x "
        f"({size_text(m.state_bytes_per_rank)} per rank + 4 MiB) x {m.ranks_per_node} ranks = "
        f"{size_text(m.ram_per_node_bytes)}: emptyDir {{medium: Memory, sizeLimit: {m.size_limit}}} "
        f"at checkpoint.memory.dir (Docker: --shm-size), apart from NCCL's /dev/shm",
    ]
    if m.interval_steps is None:
        lines.append("tier 0 interval: needs a save cost and a step time (--run-dir, the bench or --step-seconds)")
    else:
        lines.append(
            f"tier 0 interval: every {m.interval_steps} step(s): {m.save_seconds:.3f} s per save / "
            f"({m.interval_steps} x {m.step_seconds:.3f} s step) = {m.cost_fraction:.2%} of training "
            f"(budget {m.budget:.0%}); a failure loses at most {m.interval_steps} step(s)"
        )
    return lines


def format_plan(tiers: list[TierPlan], capacity: CapacityPlan | None, mtbf_s: float) -> str:
    lines = [f"job MTBF: {mtbf_s:.0f} s ({mtbf_s / 3600:.2f} h)", ""]
    lines.append(
        f"{'tier':<12} {'save s':>8} {'restore s':>10} {'Young s':>9} {'Daly s':>9} {'steps':>7} {'goodput':>8}"
    )
    for t in tiers:
        steps = "-" if t.interval_steps is None else str(t.interval_steps)
        lines.append(
            f"{t.tier:<12} {t.save_seconds:>8.2f} {t.restore_seconds:>10.1f} {t.young_interval_s:>9.0f} "
            f"{t.daly_interval_s:>9.0f} {steps:>7} {t.goodput:>8.2%}"
        )
    if capacity is not None:
        c = capacity
        lines += [
            "",
            f"checkpoint: {c.params / 1e9:.2f} B params x {c.bytes_per_param} B "
            f"({PER_PARAM_WORDS.get(c.bytes_per_param, 'weights + optimizer')}) = {size_text(c.checkpoint_bytes)}",
            f"tier 1 per node (keep x replication, +{c.headroom:.0%}): {size_text(c.per_node_tier1_bytes)}",
            f"staging (shared FS): {size_text(c.staging_bytes)};  S3: {size_text(c.s3_bytes)}",
        ]
    return "\n".join(lines)


def as_dict(tiers: list[TierPlan], capacity: CapacityPlan | None, mtbf_s: float) -> dict[str, object]:
    return {
        "mtbf_seconds": mtbf_s,
        "tiers": [asdict(t) for t in tiers],
        "capacity": asdict(capacity) if capacity else None,
    }

"""`pretrain plan` against hand-computed values (Meta's Llama 3 record: 466 interruptions in 54 days),
the parameter count and state bytes it derives against the model actually built, and the figures it
takes from a run's records and the bench results."""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from pretrain.checkpointing.memory_tier import PAYLOAD_SLACK_BYTES
from pretrain.commands.plan import (
    SLOT_SLACK_BYTES,
    daly_interval,
    goodput,
    mtbf_from_failures,
    plan_capacity,
    plan_memory_tier,
    plan_tier,
    young_interval,
)
from pretrain.commands.plan_model import model_size
from pretrain.commands.plan_sources import costs_from_bench, costs_from_run
from pretrain.config import load_config, padded_vocab_size
from pretrain.model import build_model, transformer_config
from pretrain.optim import CpuAdamW
from tests.helpers import PYTHON, REPO, TINY

M = 10012.017167  # 54 days * 86400 s / 466 interruptions (the job uses the whole cluster)


def test_mtbf_from_a_failure_record() -> None:
    assert mtbf_from_failures(466, 54, 16384, 16384) == pytest.approx(M)
    # A 1,024-GPU job on that fleet fails 16x less often.
    assert mtbf_from_failures(466, 54, 16384, 1024) == pytest.approx(160192.27, rel=1e-6)
    with pytest.raises(ValueError):
        mtbf_from_failures(0, 54, 16384, 1024)


def test_young_and_daly_intervals() -> None:
    assert young_interval(30, M) == pytest.approx(775.0620, rel=1e-6)  # sqrt(2 * 30 * 10012)
    assert daly_interval(30, M) == pytest.approx(755.1910, rel=1e-6)
    assert daly_interval(30_000, 10_000) == 10_000  # delta >= 2M: checkpoint every MTBF
    assert goodput(755.1910, 30, 300, M) == pytest.approx(0.892597, abs=1e-6)


def test_tier_plan_and_capacity() -> None:
    t = plan_tier("local", 30, 240, M, step_s=2.5, detect_restart_s=60)
    assert t.interval_steps == round(755.1910 / 2.5) == 302
    assert t.goodput == pytest.approx(0.892597, abs=1e-6)
    c = plan_capacity(8e9, nodes=4, local_keep=2, replication_factor=2, staging_keep=2, s3_keep=5, headroom=0.25)
    assert c.bytes_per_param == 14 and c.checkpoint_bytes == 112e9
    assert c.per_node_tier1_bytes == pytest.approx(140e9)  # 112/4 * 2 * 2 * 1.25
    assert c.staging_bytes == pytest.approx(280e9) and c.s3_bytes == pytest.approx(700e9)


def test_cli() -> None:
    out = subprocess.run(
        [
            PYTHON, "-m", "pretrain", "plan",
            "--failures", "466", "--days", "54", "--cluster-gpus", "16384", "--job-gpus", "16384",
            "--tier", "local:30:240", "--tier", "s3:300:1800", "--step-seconds", "2.5",
            "--params", "8e9", "--nodes", "4", "--json",
        ],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["mtbf_seconds"] == pytest.approx(M)
    local, s3 = data["tiers"]
    assert local["daly_interval_s"] == pytest.approx(755.1910, rel=1e-6) and local["interval_steps"] == 302
    assert s3["daly_interval_s"] > local["daly_interval_s"] and s3["goodput"] < local["goodput"]
    assert data["capacity"]["checkpoint_bytes"] == 112e9
    bad = subprocess.run([PYTHON, "-m", "pretrain", "plan", "--tier", "local:30:240"], capture_output=True, text=True)
    assert bad.returncode == 2 and "give --mtbf-hours or --failures" in bad.stderr


# --- figures derived from a config, and taken from records (pretrain plan --config / --run-dir) ---

LLAMA3_8B = 8_030_261_248  # Meta's published parameter count of Llama 3 8B (no biases)


@contextlib.contextmanager
def one_rank_megatron(tmp_path: Path) -> Iterator[None]:
    """A 1-rank gloo group and Megatron's parallel state in this process, torn down after."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


VARIANTS = {
    "tiny": [],
    # every shape switch the count depends on: GQA, SwiGLU with its own MLP width, RMSNorm,
    # an untied output layer, learned positions, a vocabulary padded up
    "llama-like": [
        "model.num_query_groups=2",
        "model.swiglu=true",
        "model.ffn_hidden_size=200",
        "model.normalization=RMSNorm",
        "model.untie_embeddings=true",
        "model.position_embedding=learned_absolute",
        "model.vocab_size=300",
    ],
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_derived_parameter_count_and_state_bytes_equal_the_built_model(variant: str, tmp_path: Path) -> None:
    cfg = load_config(str(TINY), VARIANTS[variant])
    size = model_size(cfg, world_size=1)
    with one_rank_megatron(tmp_path):
        model = build_model(cfg.model, padded_vocab_size(cfg), transformer_config(cfg.model, cfg.parallel))
        optimizer = CpuAdamW(cfg.optimizer, model)
        built = sum(p.numel() for p in model.parameters())
        tensors = list(model.state_dict().values()) + [
            t for s in optimizer.opt.state.values() for k, t in s.items() if k != "step"
        ]
        state_bytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    assert size.params == size.params_per_rank == built
    assert size.state_bytes_per_rank == state_bytes  # fp32 weights + Adam m, v: 12 B per parameter


def test_a_plain_gpt_count_is_the_standard_formula_and_the_8b_config_is_llama3_8b() -> None:
    # Narayanan et al. (SC'21) 5.1: 12 L h^2 (1 + 13 / 12h + (V + s) / 12 L h) (+ the final norm's 2h)
    gpt = load_config(
        str(TINY),
        ["model.num_layers=24", "model.hidden_size=2048", "model.num_attention_heads=16", "model.seq_length=2048",
         "model.position_embedding=learned_absolute", "model.vocab_size=50257"],
    )  # fmt: skip
    L, h, s, V = 24, 2048, 2048, 50304  # 50257 padded to a multiple of 128
    assert model_size(gpt, 1).params == 12 * L * h * h + 13 * L * h + (V + s) * h + 2 * h
    big = load_config(str(REPO / "configs" / "gpt-8b-h100.yaml"), [])
    size = model_size(big, world_size=32)  # 4 nodes x 8 GPUs: tp 2 x pp 2 x dp 8
    biases = 32 * (4096 + 2 * 1024 + 4096 + 2 * 14336 + 4096)  # Megatron's add_bias_linear (kept on)
    assert size.params - biases == LLAMA3_8B
    assert (size.tp, size.pp, size.dp, size.distributed_optimizer) == (2, 2, 8, True)
    # the heaviest stage per TP rank (the last: 16 layers, the final norm and the untied output
    # layer, one norm more than the first's embeddings); bf16 weights (each DP rank saves its
    # slice) + fp32 master and Adam m, v, each divided over the 8 data-parallel ranks
    layer = 4096 * (4096 + 2048) + 6144 + 4096 * 4096 + 4096 * 28672 + 28672 + 14336 * 4096
    per_rank = 16 * (layer // 2 + 2 * 4096 + 2 * 4096) + 4096 + 128256 * 4096 // 2
    assert size.params_per_rank == per_rank
    assert size.state_bytes_per_rank == per_rank * 2 // 8 + per_rank * 12 // 8


def test_tier0_ram_and_interval_keep_the_cost_within_the_budget() -> None:
    m = plan_memory_tier(7e9, ranks_per_node=8, slots=2, peer_copies=1, save_s=0.25, step_s=5.0, budget=0.02)
    assert SLOT_SLACK_BYTES == PAYLOAD_SLACK_BYTES  # the start-up check's allowance per slot
    assert m.ram_per_node_bytes == 2 * 2 * (7e9 + SLOT_SLACK_BYTES) * 8
    assert m.size_limit == "209Gi"  # 224.13 GB = 208.7 GiB, rounded up
    assert plan_memory_tier(5e6, 2, 2, 1, None, None).size_limit == "71Mi"  # 70.1 MiB
    assert m.interval_steps == 3  # 0.25 / (0.02 * 5) = 2.5 -> every 3 steps
    assert m.cost_fraction == pytest.approx(0.25 / 15) and m.cost_fraction <= 0.02
    assert plan_memory_tier(1e9, 1, 2, 0, save_s=0.05, step_s=5.0).interval_steps == 1
    assert plan_memory_tier(1e9, 1, 2, 0, save_s=None, step_s=5.0).interval_steps is None


def _write_run(run: Path) -> None:
    """A run's records as the trainer writes them: steps of 1.0 s, 1.5 s after a tier-1 save
    (blocked 0.1 s), 1.2 s after a tier-0 save; one restore from tier 0 of 3 s in attempt 2."""
    rows, events, t = [], [], 0.0
    for step in range(1, 21):
        t += 1.5 if step - 1 in (6, 12) else 1.2 if step - 1 in (3, 9, 15) else 1.0
        rows.append({"attempt": "a1", "step": step, "time": t, "loss": 1.0})
    for step in (6, 12):
        events.append({"attempt": "a1", "event": "save", "tier": "local", "step": step, "blocked_seconds": 0.1})
    for step in (3, 9, 15):
        events.append({"attempt": "a1", "event": "save", "tier": "memory", "step": step, "blocked_seconds": 0.01})
    (run / "attempts").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    for n, restored in ((1, None), (2, {"tier": "memory", "step": 20, "seconds": 3.0})):
        (run / "attempts" / f"attempt-{n:02d}.json").write_text(json.dumps({"attempt": n, "restored": restored}))


def test_costs_come_from_a_runs_records(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "r"
    _write_run(run)
    costs = costs_from_run(run)
    assert costs.step_s.value == pytest.approx(1.0)
    assert costs.save["local"].value == pytest.approx(0.5)  # step excess, not the 0.1 s blocked
    assert costs.save["memory"].value == pytest.approx(0.2)
    assert costs.restore["memory"].value == 3.0 and "attempts" in costs.restore["memory"].source
    out = subprocess.run(
        [PYTHON, "-m", "pretrain", "plan", "--mtbf-hours", "24", "--config", str(TINY), "--ranks-per-node", "2",
         "--run-dir", str(run), "--bench-results", str(tmp_path / "none")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    # every figure says where it came from; tier 0's interval: 0.2 s / (0.02 x 1.0 s) = 10 steps
    assert f"save memory: 0.200 s ({run}: step excess 0.200 s, blocked 0.010 s" in out.stdout
    assert "derived from" in out.stdout and "metrics.jsonl: median of" in out.stdout
    assert "tier 0 interval: every 10 step(s)" in out.stdout
    assert "tier local: no restore figure" in out.stdout  # never invented
    bad = subprocess.run(
        [PYTHON, "-m", "pretrain", "plan", "--mtbf-hours", "24", "--run-dir", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "no such directory; fix:" in bad.stderr and len(bad.stderr.splitlines()) == 1
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"attempt": "a1", "step": 21, "ti')  # a rank killed mid-line: the rest stands
    assert costs_from_run(run).step_s.value == pytest.approx(1.0)
    (run / "events.jsonl").write_text("garbage\n" + (run / "events.jsonl").read_text())
    with pytest.raises(ValueError, match=r"events.jsonl:1: not a JSON record .*; fix:"):
        costs_from_run(run)


def test_costs_come_from_the_bench_results_scaled_by_bytes(tmp_path: Path) -> None:
    case = {"repeats": 3, "cost_s": {"median": 0.6, "spread": [0.5, 0.7]}}
    row = {"state_mb": 300, "blocked_thread_s": 0.01, "save_cost": {"cases": {"tier1-thread": case, "tier0": case}}}
    (tmp_path / "2026-12-02.json").write_text(json.dumps({"blocked": [row, {**row, "state_mb": 2000}]}))
    io = {"size_mb": 300, "restore_cold": {"measured_s": 0.3}, "peer_restore": {"measured_s": 0.9}}
    (tmp_path / "2026-12-01.json").write_text(json.dumps({"io": [io], "blocked": []}))
    costs = costs_from_bench(tmp_path, 600e6, "thread")
    assert costs.save["local"].value == pytest.approx(1.2) and costs.save["memory"].value == pytest.approx(1.2)
    assert "2026-12-02.json" in costs.save["local"].source and "x2 by bytes" in costs.save["local"].source
    assert costs.restore["local"].value == pytest.approx(0.6) and costs.restore["replica"].value == pytest.approx(1.8)
    assert costs_from_bench(tmp_path, 600e6, "fork").save == {}  # no fork figure: none invented

"""A checkpoint saved at TP=2 loads at TP=1/DP=2: exact tensors, no sample skipped or repeated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import full_tensors, overrides_for, probe_restore, read_jsonl, torchrun

pytestmark = pytest.mark.slow
GBS = 8


def _audit_positions(run_dir: Path) -> dict[int, list[int]]:
    """step -> global sample positions consumed (union over DP ranks; last attempt wins)."""
    per_step: dict[int, dict[int, list[int]]] = {}
    for path in sorted((run_dir / "data-audit").glob("rank-*.jsonl")):
        for rec in read_jsonl(path):
            per_step.setdefault(rec["step"], {})[rec["dp_rank"]] = rec["positions"]
    return {step: sorted(p for parts in ranks.values() for p in parts) for step, ranks in per_step.items()}


def test_tp2_checkpoint_loads_at_tp1_dp2(tmp_path: Path, corpus: Path) -> None:
    job = tmp_path / "job"
    tp2 = overrides_for(
        job,
        corpus,
        **{
            "parallel.tp": 2,
            "train.steps": 10,
            "checkpoint.local.interval": 10,
            "data.audit": "true",
            "schedule.decay_steps": 40,
        },
    )
    torchrun(job, 2, tp2)
    saved = full_tensors(job / "reshard" / "t" / "steps" / "step-000000010" / "model")

    # Restore at TP=1/DP=2 and re-save unchanged: every full tensor must be bit-identical.
    tp1 = [o for o in tp2 if not o.startswith("parallel.tp=")] + ["parallel.tp=1"]
    out = probe_restore(job, 2, tp1)
    log = out.stdout + out.stderr
    assert "PROBE restored=10 rng_restored=False" in log
    assert "tier 1-2 copies saved at another topology are not loadable here, using the reshardable tier" in log
    resaved = full_tensors(job / "reshard-resaved" / "t" / "steps" / "step-000000010" / "model")
    model_keys = [k for k in saved if not k.startswith("optimizer.")]
    moment_keys = [k for k in saved if k.startswith("optimizer.state.exp_avg")]
    assert "embedding.word_embeddings.weight" in model_keys
    assert len(moment_keys) == 2 * len(model_keys)
    for key in model_keys + moment_keys:
        assert key in resaved, key
        assert saved[key].shape == resaved[key].shape
        assert torch.equal(saved[key], resaved[key]), f"{key} changed across TP=2 -> TP=1/DP=2"

    # Continue training at TP=1/DP=2 to step 15: the consumed samples have no gap and no repeat.
    torchrun(job, 2, [o.replace("train.steps=10", "train.steps=15") for o in tp1])
    positions = _audit_positions(job / "runs" / "t")
    assert sorted(positions) == list(range(1, 16))
    consumed = [p for step in sorted(positions) for p in positions[step]]
    assert consumed == list(range(15 * GBS)), "sample positions must be exactly 0..N-1 in order"
    for step, pos in positions.items():
        assert pos == list(range((step - 1) * GBS, step * GBS))


def test_pp2_checkpoint_loads_at_pp1_dp2(tmp_path: Path, corpus: Path) -> None:
    job = tmp_path / "job"
    pp2 = overrides_for(
        job,
        corpus,
        **{
            "parallel.pp": 2,
            "model.untie_embeddings": "true",
            "train.steps": 10,
            "checkpoint.local.interval": 10,
            "schedule.decay_steps": 40,
        },
    )
    torchrun(job, 2, pp2)
    saved = full_tensors(job / "reshard" / "t" / "steps" / "step-000000010" / "model")
    pp1 = [o for o in pp2 if not o.startswith("parallel.pp=")] + ["parallel.pp=1"]
    probe_restore(job, 2, pp1)
    resaved = full_tensors(job / "reshard-resaved" / "t" / "steps" / "step-000000010" / "model")
    keys = [k for k in saved if not k.startswith("optimizer.") or k.startswith("optimizer.state.exp_avg")]
    assert "decoder.layers.mlp.linear_fc1.weight" in keys and "output_layer.weight" in keys
    for key in keys:
        assert torch.equal(saved[key], resaved[key]), f"{key} changed across PP=2 -> PP=1/DP=2"

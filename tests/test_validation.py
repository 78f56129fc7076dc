"""Validation loss on the valid split: logged to metrics.jsonl (its own kind), Prometheus and
TensorBoard; it draws no training randomness (training losses equal a run without evaluation) and
gives the same value for the same weights after a SIGKILL and resume, on a real workload shape
(trained BPE tokenizer, two-prefix blend)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pretrain.config import load_config, validate
from pretrain.errors import ConfigError
from pretrain.observability.metrics import TrainingMetrics
from tests.helpers import (
    TINY,
    blend_override,
    events,
    ft_launch,
    kill_rank_at,
    metrics_by_step,
    overrides_for,
    read_jsonl,
    torchrun,
)

COMMON = {
    "train.steps": 20,
    "checkpoint.local.interval": 10,
    "checkpoint.reshardable.interval": 20,
    "data.split": "90,10,0",
}


def _validation(run_dir: Path) -> dict[int, float]:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    out: dict[int, float] = {}
    for row in rows:
        if row.get("kind") == "validation":
            out[row["step"]] = row["loss"]  # a step evaluated again after a restore keeps the newest
    return out


@pytest.mark.slow
def test_validation_draws_no_training_randomness_and_resumes_exactly(tmp_path: Path, hf_corpora: dict) -> None:
    """The heartbeat test on a real workload: a trained BPE tokenizer, a two-prefix blend and
    evaluation. Training losses equal a run without evaluation; after a SIGKILL the resumed run's
    losses and validation losses equal the uninterrupted run's; then a resume with another tokenizer
    of the same vocabulary size is refused in one line."""
    a, b = hf_corpora["web"], hf_corpora["code"]
    workload = {
        **COMMON,
        "data.tokenizer": "huggingface",
        "data.tokenizer_path": str(hf_corpora["tok_a"]),
        "data.blend": blend_override(a, b, 0.6, 0.4),
    }
    plain = tmp_path / "plain"
    torchrun(plain, 2, overrides_for(plain, a, **workload))
    evaluated = tmp_path / "eval"
    tb = evaluated / "tb"
    evaluate = {"eval.interval": 10, "eval.iters": 2}
    torchrun(evaluated, 2, overrides_for(evaluated, a, **workload, **evaluate, **{"logging.tensorboard_dir": str(tb)}))
    crash = tmp_path / "crash"
    ft_launch(crash, 2, overrides_for(crash, a, **workload, **evaluate, **kill_rank_at(1, 17)))
    base, ev, cr = (metrics_by_step(d / "runs" / "t") for d in (plain, evaluated, crash))
    assert sorted(base) == sorted(ev) == sorted(cr) == list(range(1, 21))
    for step in range(1, 21):
        assert base[step]["loss"] == ev[step]["loss"] == cr[step]["loss"], f"training loss differs at step {step}"
        assert base[step]["grad_norm"] == ev[step]["grad_norm"] == cr[step]["grad_norm"]

    v_eval, v_crash = _validation(evaluated / "runs" / "t"), _validation(crash / "runs" / "t")
    # Step 10's validation ran before the kill, step 20's after the resume.
    assert sorted(v_eval) == sorted(v_crash) == [10, 20]
    assert v_eval == v_crash, "the same weights must give the same validation loss after a resume"
    assert v_eval[20] < v_eval[10], "validation loss must fall as training goes on"
    assert [r["step"] for r in events(crash / "runs" / "t") if r["event"] == "restore"] == [10]

    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"lm loss", "lm loss validation", "learning-rate", "grad-norm", "throughput"} <= tags
    assert [e.step for e in acc.Scalars("lm loss validation")] == [10, 20]
    assert acc.Scalars("lm loss validation")[0].value == pytest.approx(v_eval[10])

    other = {**workload, "train.steps": 50, "data.tokenizer_path": str(hf_corpora["tok_b"])}
    proc = torchrun(plain, 2, overrides_for(plain, a, **other), check=False)
    assert proc.returncode != 0
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if "IncompatibleCheckpoint:" in x and "failed" in x]
    assert lines and "trained with tokenizer huggingface" in lines[0] and "fix:" in lines[0], proc.stderr[-2000:]
    assert "tok-a.json" in lines[0] and "tok-b.json" in lines[0]


def test_the_exporter_serves_the_newest_validation_loss() -> None:
    metrics = TrainingMetrics("r")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics)
    assert b"validation_loss{" not in generate_latest(registry), "no series before the first evaluation"
    metrics.validated(200, 2.5)
    text = generate_latest(registry).decode()
    assert 'validation_loss{run_id="r"} 2.5' in text and 'validation_step{run_id="r"} 200.0' in text


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["eval.interval=10"], "data.split: '100,0,0' leaves the valid split empty while eval.interval=10; fix:"),
        (["data.split=90,10"], "data.split: '90,10' is not three non-negative weights; fix:"),
        (["data.split=90,-1,0"], "data.split: '90,-1,0' is not three non-negative weights; fix:"),
        (["eval.iters=0"], "eval.interval: interval must be >= 0 and iters >= 1; fix:"),
    ],
)
def test_bad_evaluation_settings_are_refused_in_one_line(overrides: list[str], message: str) -> None:
    cfg = load_config(TINY, overrides)
    with pytest.raises(ConfigError) as caught:
        validate(cfg, 2, False)
    assert message in str(caught.value) and "\n" not in str(caught.value)

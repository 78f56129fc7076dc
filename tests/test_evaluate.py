"""``pretrain evaluate``: a checkpoint's validation loss as JSON, the same for the same weights at
any topology (a TP=2 reshardable checkpoint evaluated at TP=1 and TP=2, and its tier-1 copy), and a
corrupt checkpoint, one without the training run's key and one signed by another key refused."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from pretrain.resilience.standby.beside import with_standby
from tests.helpers import PYTHON, TINY, flip_byte, job_env, overrides_for, torchrun, torchrun_prefix
from tiering.trust.run_key import RunKey
from tiering.trust.signature import SIGNATURE_NAME, ManifestSigner

pytestmark = pytest.mark.slow


def _evaluate(
    tmp: Path, nproc: int, checkpoint: Path | str, overrides: list[str], standby: bool = True
) -> subprocess.CompletedProcess[str]:
    """``pretrain evaluate`` on ``nproc`` ranks; a single process too is forked from the worker's
    standby process unless ``standby`` is False (the user's plain ``python -m pretrain evaluate``,
    which imports torch and Megatron itself: kept for one check, the corrupt shard)."""
    launch = torchrun_prefix(nproc) if nproc > 1 else [PYTHON]
    cmd = [*launch, "-m", "pretrain", "evaluate", "--config", str(TINY), "--checkpoint", str(checkpoint)]
    if nproc == 1 and standby:
        cmd = with_standby(cmd)
    for item in overrides:
        cmd += ["--set", item]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=job_env(tmp), cwd=tmp)


def _result(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads([x for x in proc.stdout.splitlines() if x.startswith("{")][-1])


def test_the_same_loss_at_any_topology(tmp_path: Path, corpus: Path) -> None:
    common = {
        "train.steps": 10,
        "schedule.decay_steps": 20,  # a run of 10 steps needs a schedule past its warmup
        "checkpoint.reshardable.interval": 10,
        "data.split": "90,10,0",
        "eval.iters": 2,
    }
    train = tmp_path / "train"
    torchrun(train, 2, overrides_for(train, corpus, **common, **{"parallel.tp": 2}))
    reshardable = train / "reshard" / "t" / "steps" / "step-000000010"
    tier1 = train / "ckpt" / "t" / "ranks" / "rank-00000" / "steps" / "step-000000010"
    ev = tmp_path / "ev"
    # Evaluate loads only steps signed with the training run's key, read from where it is named.
    unkeyed = _evaluate(ev, 1, reshardable, overrides_for(ev, corpus, **common))
    # (its own run directory's key: the training run's steps do not verify under it)
    lines = [x for x in unkeyed.stderr.splitlines() if "run key" in x and "run_key_file" in x]
    assert unkeyed.returncode != 0 and lines and str(reshardable) in lines[0], unkeyed.stderr[-2000:]
    common["checkpoint.integrity.run_key_file"] = str(train / "runs" / "t" / "run.key")
    at_tp1 = _result(_evaluate(ev, 1, reshardable, overrides_for(ev, corpus, **common)))
    at_tp2 = _result(_evaluate(ev, 2, reshardable, overrides_for(ev, corpus, **common, **{"parallel.tp": 2})))
    local = _result(_evaluate(ev, 2, tier1, overrides_for(ev, corpus, **common, **{"parallel.tp": 2})))
    assert at_tp1["step"] == at_tp2["step"] == local["step"] == 10
    assert (at_tp1["kind"], at_tp2["kind"], local["kind"]) == ("reshardable", "reshardable", "local")
    assert at_tp1["topology"]["tp"] == 1 and at_tp2["topology"]["tp"] == 2
    assert at_tp1["loss"] == pytest.approx(at_tp2["loss"], rel=1e-5)
    assert local["loss"] == pytest.approx(at_tp2["loss"], rel=1e-5)
    assert at_tp1["perplexity"] == pytest.approx(2.718281828 ** at_tp1["loss"], rel=1e-6)

    # Tier 3: promoted by the uploader, downloaded and verified by evaluate, the same loss.
    store = f"file://{tmp_path / 's3'}"
    up = [PYTHON, "-m", "tiering", "upload", store, "--run-id", "t", "--staging-dir", str(train / "reshard"), "--once"]
    up += ["--run-key-file", str(train / "runs" / "t" / "run.key")]  # the job's key: its steps are signed with it
    subprocess.run(up, check=True, capture_output=True, timeout=120, env=job_env(ev))
    remote = _result(_evaluate(ev, 1, store, overrides_for(ev, corpus, **common)))
    assert (remote["kind"], remote["step"]) == ("s3", 10)
    assert remote["loss"] == pytest.approx(at_tp1["loss"], rel=1e-5)

    # A step signed by someone without the run's key (whatever else it holds) is refused unloaded.
    good_signature = (reshardable / SIGNATURE_NAME).read_bytes()
    forged = ManifestSigner(RunKey(os.urandom(32))).sign((reshardable / "manifest.json").read_bytes())
    (reshardable / SIGNATURE_NAME).write_bytes(forged)
    unsigned = _evaluate(ev, 1, reshardable, overrides_for(ev, corpus, **common))
    lines = [x for x in unsigned.stderr.splitlines() if "signature does not verify" in x]
    assert unsigned.returncode != 0 and lines and "run_key_file" in lines[0], unsigned.stderr[-2000:]
    (reshardable / SIGNATURE_NAME).write_bytes(good_signature)

    flip_byte(next((reshardable / "model").glob("*.distcp")))
    bad = _evaluate(ev, 1, reshardable, overrides_for(ev, corpus, **common), standby=False)
    assert bad.returncode != 0
    lines = [x for x in bad.stderr.splitlines() if "does not verify" in x]
    assert lines and str(reshardable) in lines[0] and "fix:" in lines[0], bad.stderr[-2000:]

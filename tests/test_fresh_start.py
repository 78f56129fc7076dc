"""No silent fresh start: a run with committed checkpoints that no step of which every rank can
obtain refuses to start from step 0 (one line: where the copies are, why, the fix) and touches
none of them, unless ``checkpoint.allow_fresh_start`` is set; two launchers that report one node
name are refused at start."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers import events, overrides_for, start_nodes, torchrun, wait_nodes

pytestmark = pytest.mark.slow


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("steps/step-*"))


def test_committed_steps_that_no_rank_set_can_load_refuse_a_fresh_start(tmp_path: Path, corpus: Path) -> None:
    common = {"train.steps": 20, "checkpoint.local.interval": 10, "checkpoint.reshardable.enabled": "false"}
    torchrun(tmp_path, 2, overrides_for(tmp_path, corpus, **common))
    node = tmp_path / "ckpt" / "t"
    # Rank 1's copies are lost (its own and the replica rank 0 held): no step has every rank's part.
    shutil.rmtree(node / "ranks" / "rank-00001")
    shutil.rmtree(node / "replicas" / "rank-00001")
    kept = _steps(node / "ranks" / "rank-00000")
    assert kept == ["step-000000010", "step-000000020"]

    proc = torchrun(tmp_path, 2, overrides_for(tmp_path, corpus, **{**common, "train.steps": 30}), check=False)
    assert proc.returncode != 0
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if "FreshStartRefused:" in x and "failed" in x]
    assert lines, (proc.stdout + proc.stderr)[-3000:]
    line = lines[0]
    assert "run t has committed checkpoints but no step can be obtained by every rank" in line
    assert f"{node}: rank 0 steps [20, 10], replica of rank 0 steps [20, 10]" in line
    assert "fix:" in line and "checkpoint.allow_fresh_start=true" in line
    assert _steps(node / "ranks" / "rank-00000") == kept, "a refused start must not touch the copies it names"
    fresh = [e["event"] for e in events(tmp_path / "runs" / "t")].count("fresh_start")
    assert fresh == 1, "only the first run started from step 0"

    allowed = overrides_for(tmp_path, corpus, **{**common, "train.steps": 20, "checkpoint.allow_fresh_start": "true"})
    torchrun(tmp_path, 2, allowed)
    assert [e["event"] for e in events(tmp_path / "runs" / "t")].count("fresh_start") == 2


def test_two_launchers_reporting_one_node_name_are_refused(tmp_path: Path, corpus: Path) -> None:
    """Two nodes whose hosts share a hostname and have no NODE_NAME: refused before any restore."""
    over = overrides_for(tmp_path, corpus, **{"train.steps": 20})
    procs = start_nodes(tmp_path, over, max_restarts=0, nproc=1, named=False)
    outs = list(wait_nodes(tmp_path, procs, timeout=240).values())
    assert all(p.returncode != 0 for p in procs.values())
    text = "\n".join(outs)
    refusals = [x for x in text.splitlines() if "both report node name" in x and "failed" in x]
    assert refusals, text[-3000:]
    assert "node 0 (host " in refusals[0] and "node 1 (host " in refusals[0] and "fix: set NODE_NAME" in refusals[0]
    assert not any((tmp_path / f"local-{n}" / "t" / "ranks").exists() for n in procs), "refused before any save"

"""The Slurm requeue's choice of node (deployment review 16): ``pretrain launch --requeue-evidence``
reads the run's attempt records (real files, as rank 0 writes them) and blames a node only for its
own failure: a crashed or killed rank's host, never a rank that lost a peer, never a user error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pretrain.commands.launch import blamed_node, requeue_evidence
from tests.helpers import TINY

HOSTS = {"gpu-001": [0, 1], "gpu-002": [2, 3], "gpu-003": [4, 5]}


def _record(run: Path, number: int, failure: dict[str, Any] | None, **extra: Any) -> None:
    d = run / "attempts"
    d.mkdir(parents=True, exist_ok=True)
    rec = {"attempt": number, "id": f"a{number}", "status": "failed", "world_size": 6, "ranks_by_host": HOSTS}
    rec["failure"] = failure
    (d / f"attempt-{number:02d}.json").write_text(json.dumps({**rec, **extra}))


def _failure(rank: int, classification: str = "infrastructure", **extra: Any) -> dict[str, Any]:
    return {"rank": rank, "classification": classification, "exception": None, "exit_code": -9, **extra}


@pytest.mark.parametrize(
    ("failure", "blamed"),
    [
        (_failure(3, evidence="rank 3 killed by SIGKILL"), "gpu-002"),
        (_failure(0, peer_lost=True, exception="RuntimeError: Connection closed by peer"), None),  # a victim
        (_failure(4, "user", exception="ConfigError: bad key"), None),  # follows the run anywhere
        (_failure(5, "numerical"), None),
        (_failure(2, ranks=[2, 4], evidence="ranks [2, 4] ended without a report"), None),  # two nodes
        (None, None),  # died open, no evidence left: every rank silent, on three nodes
    ],
)
def test_only_the_failed_ranks_own_node_is_blamed(tmp_path: Path, failure: dict | None, blamed: str | None) -> None:
    _record(tmp_path, 1, _failure(1, evidence="an older attempt"))  # only the newest attempt counts
    _record(tmp_path, 2, failure, last_step=40, restored={"step": 30})
    got = blamed_node(tmp_path)
    assert (got[0] if got else None) == blamed
    if blamed:
        assert got[1] == "attempt 2: rank 3 on gpu-002: rank 3 killed by SIGKILL"


def test_the_requeue_line_says_the_node_whether_the_attempt_trained_and_why(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "t"
    sets = [f"run.dir={tmp_path / 'runs'}", "run.id=t"]
    assert requeue_evidence(str(TINY), sets, env={}) == "- 0 no attempt record blames a node"
    _record(run, 1, _failure(2, evidence="rank 2 killed by SIGKILL"), last_step=40, restored={"step": 30})
    assert (
        requeue_evidence(str(TINY), sets, env={}) == "gpu-002 1 attempt 1: rank 2 on gpu-002: rank 2 killed by SIGKILL"
    )
    _record(run, 2, _failure(0, peer_lost=True), last_step=40, restored={"step": 40})
    assert requeue_evidence(str(TINY), sets, env={}) == "- 0 no attempt record blames a node"

"""`pretrain drill`: the seed's recovery experiment end to end (kill at 135 -> 100, restart ->
150, damaged step 200 -> 150, three failures -> stop, a kill with tier 0 on -> at most one step lost),
with its report files; no node agent of its runs outlives it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pretrain.commands.demo import FT_CONFIG
from tests.helpers import agents_serving, run_verb

pytestmark = pytest.mark.slow

# The drill runs six jobs one after the other; in CI at load 9-14 on 2 cores it was still in its
# fifth when the 360 s this test allowed ran out (SIGTERM to its launcher). A deadline for a wedged
# drill, not a speed target: the drill's own numbers are in its report.
DRILL_DEADLINE_S = 1080


@pytest.mark.timeout(DRILL_DEADLINE_S + 120)
def test_drill_passes_every_check_and_writes_its_report(tmp_path: Path) -> None:
    work = tmp_path / "drill"
    proc = run_verb(tmp_path, "drill", work, timeout=DRILL_DEADLINE_S)
    report = json.loads((work / "drill-report.json").read_text())
    failed = [c for c in report["checks"] if not c["passed"]]
    assert proc.returncode == 0 and report["passed"] and not failed, failed or proc.stdout[-3000:]
    # The drill releases its runs' node agents (the last runs end in failures, which never tell them).
    deadline = time.monotonic() + 10
    while agents_serving(work) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not agents_serving(work), "an agent of the drill outlived it"
    names = [c["name"] for c in report["checks"]]
    assert names == [
        "baseline",
        "recover-from-100",
        "recover-after-a-kill-during-recovery",
        "no-orphans",
        "data-watermark",
        "matches-baseline",
        "step-150-loads",
        "reject-200-fallback-150",
        "stops-after-3-failures",
        "tier0-loses-at-most-one-step",
    ]
    first = report["recoveries"][0]
    assert first["restored"] == {"tier": "local", "step": 100, "seconds": first["restored"]["seconds"]}
    # recovered on the kill's exit, not on the heartbeat timeout (which a hung rank would have needed)
    heartbeat_s = FT_CONFIG["fault_tolerance"]["rank_heartbeat_timeout"]
    assert first["lost_steps"] == 34 and 0 < first["rto_seconds"] < heartbeat_s, first
    tier0 = [r for r in report["recoveries"] if (r["restored"] or {}).get("tier") == "memory"]
    assert len(tier0) == 1 and tier0[0]["lost_steps"] <= 1, report["recoveries"]
    assert report["save_seconds"]["local"] and report["load_seconds"]
    md = (work / "drill-report.md").read_text()
    assert "Result: **PASS**" in md and "| matches-baseline | pass |" in md
    png = (work / "drill-loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

"""The soak's object-store kind against a real Ceph RGW: the store unreachable behind the soak's
proxy while the job trains on (the other short soaks: tests/test_soak.py). Its own module: it runs
in the S3 service group (tests/leftover_guard.py)."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest
import yaml

from tests.helpers import PYTHON, REPO, run


@pytest.mark.timeout(300)  # under a minute on an idle 2-core machine
@pytest.mark.slow  # a job of a minute: make test runs it, make test-fast leaves it out
def test_an_unreachable_store_is_recorded_by_the_uploader_and_training_never_restarts_for_it(
    tmp_path: Path, corpus: Path, s3_endpoint: str, bucket: str
) -> None:
    """s3-unreachable (a proxy between the uploader and a real Ceph RGW accepts connections and
    answers nothing, then resets them) and a kill of one rank (seed 6: the kill 14 steps in, after
    the first checkpoint, the store cut a step after the recovery; both land early, however fast the
    machine trains):
    the uploader's store-failure counter records the outage, no attempt starts because of it, a step
    newer than the one it had is promoted once the store answers again, and every loss matches the
    fault-free run, whose own uploader promoted to its own prefix."""
    work = tmp_path / "soak"
    cmd = [PYTHON, "-m", "pretrain", "soak", "--faults", "2", "--mtti-steps", "10", "--seed", "6", "--steps", "60"]
    cmd += ["--kinds", "s3-unreachable,kill-rank", "--workdir", str(work), "--baseline-alongside"]
    cmd += ["--data", str(corpus), "--set", f"checkpoint.s3.uri=s3://{bucket}/soak"]
    cmd += ["--set", f"checkpoint.s3.endpoint_url={s3_endpoint}"]
    proc = run(cmd, tmp_path, timeout=280, check=False)
    report = json.loads((work / "soak-report.json").read_text())
    h = report["headline"]
    detail = (h, report["faults"], proc.stdout[-3000:])
    assert proc.returncode == 0 and report["passed"], detail
    assert h["kinds_injected"] == ["kill-rank", "s3-unreachable"] and h["recovery_success_rate"] == 1.0, detail
    assert h["losses_bit_equal"] and h["record_mismatches"] == [] and h["second_resume"]["passed"], detail
    # The hang timeout in force is in the attempt's record (what tells a hang from a kill seen late).
    first = json.loads(next((work / "faulted" / "runs" / "soak" / "attempts").glob("attempt-01.json")).read_text())
    ft = yaml.safe_load((REPO / "configs" / "ft-cpu-sections.yaml").read_text())["fault_tolerance"]
    assert first["hang_timeout_s"] == ft["rank_section_timeouts"]["step"], first
    row = next(f for f in report["faults"] if f["kind"] == "s3-unreachable")
    recorded = next(e["recorded"] for e in report["events"] if e["plan"]["kind"] == "s3-unreachable")
    assert row["recorded_class"] == row["expected_class"] == "store" and row["restarted_during"] == [], row
    assert row["steps_trained_while_cut"] > 0, row  # the job went on: it never waits for its object store
    assert 0 < row["detection_s"] < row["outage_s"] < row["fault_to_next_step_s"] and row["back_s"] > 0, row
    at_fault, after = recorded["promoted_step_at_fault"], recorded["promoted_step_after"]
    assert after is not None and (at_fault is None or after > at_fault), recorded
    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket=bucket)["Contents"]]
    for run_name in ("baseline", "faulted"):  # each run's uploader, each under its own prefix
        assert any(f"/{run_name}/" in k and k.endswith("/COMMITTED") for k in keys), (run_name, keys[:20])

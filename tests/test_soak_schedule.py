"""The soak's schedule and bad input, in-process: the same seed draws the same faults, every kind
appears before any repeats, gaps average the MTTI, and each bad request is refused in one line."""

from __future__ import annotations

import statistics
import subprocess
from pathlib import Path

import pytest
import yaml

from pretrain.cli import main
from pretrain.soak.runner import Job, SoakRunner, SoakSettings
from pretrain.soak.schedule import (
    INJECTION_LATENCY_STEPS,
    KINDS,
    SoakRequestError,
    Survivability,
    check_fits,
    check_request,
    draw_schedule,
    parse_kinds,
)
from tests.helpers import TINY

CAN = Survivability(replicated=True, restart_s=4.0)
RGW = {"s3_uri": "s3://bucket/soak", "s3_endpoint": "http://127.0.0.1:7480"}


def test_one_seed_draws_one_schedule_and_another_seed_another() -> None:
    a = draw_schedule(list(KINDS), 20, 30.0, ranks=2, seed=7)
    assert a == draw_schedule(list(KINDS), 20, 30.0, ranks=2, seed=7)
    assert a != draw_schedule(list(KINDS), 20, 30.0, ranks=2, seed=8)


def test_every_kind_appears_once_before_any_repeats() -> None:
    kinds = parse_kinds(None)
    plan = draw_schedule(kinds, 2 * len(kinds) + 3, 10.0, ranks=4, seed=3)
    assert sorted(p.kind for p in plan[: len(kinds)]) == sorted(kinds)
    assert sorted(p.kind for p in plan[len(kinds) : 2 * len(kinds)]) == sorted(kinds)
    assert all(0 <= p.rank < 4 for p in plan) and all(p.rank == 0 for p in plan if KINDS[p.kind].target == "job")


def test_gaps_are_exponential_at_the_mtti() -> None:
    gaps = [p.gap_s for p in draw_schedule(["kill-rank"], 4000, 30.0, ranks=2, seed=1)]
    assert 28.0 < statistics.mean(gaps) < 32.0
    # an exponential's median is ln 2 x its mean
    assert 0.65 * 30 < statistics.median(gaps) < 0.74 * 30


def test_gaps_paced_by_steps_are_whole_steps_at_the_mtti_and_draw_the_same_faults() -> None:
    in_steps = draw_schedule(list(KINDS), 4000, 5.0, ranks=2, seed=1, in_steps=True)
    in_seconds = draw_schedule(list(KINDS), 4000, 5.0, ranks=2, seed=1)
    assert [(p.kind, p.rank) for p in in_steps] == [(p.kind, p.rank) for p in in_seconds]
    gaps = [p.gap_steps for p in in_steps]
    assert all(isinstance(g, int) and g >= 1 for g in gaps) and 4.7 < statistics.mean(gaps) < 5.5
    assert all(p.gap_steps is None for p in in_seconds)


def test_a_run_too_short_for_its_step_paced_faults_is_refused_naming_the_steps_it_needs() -> None:
    plan = draw_schedule(["kill-rank"], 3, 4.0, ranks=2, seed=2, in_steps=True)
    need = sum(p.gap_steps + INJECTION_LATENCY_STEPS for p in plan if p.gap_steps) + 5 + 1
    check_fits(plan, need, margin=5)
    with pytest.raises(SoakRequestError, match=f"fix: pass --steps {need} or more"):
        check_fits(plan, need - 1, margin=5)
    check_fits(draw_schedule(["kill-rank"], 3, 4.0, ranks=2, seed=2), 1, margin=5)  # seconds: no bound


@pytest.mark.parametrize(
    ("kinds", "mtti", "can", "says"),
    [
        ("kill-rank,explode", 30.0, CAN, "unknown kind 'explode'"),
        ("kill-rank", 1.0, CAN, "faults would arrive faster than recovery"),
        ("kill-rank,kill-node", 30.0, Survivability(False, 4.0), "cannot survive"),
        ("sigterm", 30.0, Survivability(False, 4.0), "cannot survive"),
        ("kill-rank,blocked-write", 30.0, Survivability(True, 4.0, cannot_mount="mounting needs root"), "needs root"),
        ("full-disk", 30.0, Survivability(True, 4.0, cannot_mount="/dev/fuse is missing"), "/dev/fuse is missing"),
        ("blocked-write", 30.0, Survivability(True, 4.0, background_saves=False), "no stall deadline"),
        ("blocked-write", 30.0, Survivability(True, 4.0, writer_process=False), "keeps its rank from exiting"),
        ("kill-rank,s3-unreachable", 30.0, CAN, "checkpoint.s3.uri is not set"),
        ("s3-unreachable", 30.0, Survivability(True, 4.0, s3_uri="file:///tmp/objects"), "no network to cut"),
        ("s3-unreachable", 30.0, Survivability(True, 4.0, s3_uri="s3://bucket/soak"), "endpoint_url, which is not set"),
    ],
)
def test_bad_requests_are_refused_in_one_line_with_a_fix(
    kinds: str, mtti: float, can: Survivability, says: str
) -> None:
    with pytest.raises(SoakRequestError) as err:
        check_request(parse_kinds(kinds), 5, mtti, can)
    text = str(err.value)
    assert says in text and "fix:" in text and "\n" not in text


def test_the_command_refuses_bad_input_before_running_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    work = tmp_path / "soak"
    unreplicated, threaded = tmp_path / "one-copy.yaml", tmp_path / "thread-writer.yaml"
    cfg = yaml.safe_load(TINY.read_text())
    cfg["checkpoint"]["replication"]["factor"] = 1
    unreplicated.write_text(yaml.safe_dump(cfg))
    cfg = yaml.safe_load(TINY.read_text())
    cfg["checkpoint"]["async"] = {"mode": "thread"}
    threaded.write_text(yaml.safe_dump(cfg))
    for args, says in (
        (["--faults", "3", "--mtti", "0.5"], "faults would arrive faster than recovery"),
        (["--faults", "3", "--mtti-steps", "0.5"], "paced by whole steps"),
        (["--faults", "6", "--mtti-steps", "20", "--steps", "30", "--kinds", "kill-rank"], "too short for 6 faults"),
        (["--data", str(tmp_path / "nowhere")], "no indexed dataset there"),
        (["--kinds", "kill-rank,nope"], "unknown kind 'nope'"),
        (["--kinds", "kill-rank,kill-node", "--config", str(unreplicated)], "kill-node lose a node"),
        (["--kinds", "blocked-write", "--config", str(threaded)], "thread tier-1 writer"),
        (["--kinds", "s3-unreachable"], "checkpoint.s3.uri is not set"),
        (["--kinds", "s3-unreachable", "--set", f"checkpoint.s3.uri=file://{tmp_path}"], "no network to cut"),
        (["--kinds", "s3-unreachable", "--set", "checkpoint.s3.uri=s3://b/p"], "endpoint_url, which is not set"),
    ):
        rc = main(["soak", *args, "--workdir", str(work)])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and says in err and len(err.splitlines()) == 1, err
    assert not work.exists()


def test_a_config_that_survives_a_stall_is_not_refused_for_the_storage_kinds() -> None:
    check_request(parse_kinds("blocked-write,full-disk,kill-rank"), 5, 30.0, CAN)
    # a thread writer survives a full disk (it fails, it does not hang)
    check_request(parse_kinds("full-disk"), 5, 30.0, Survivability(True, 4.0, writer_process=False))


def test_the_store_kind_is_not_refused_with_an_s3_uri_and_an_endpoint() -> None:
    check_request(parse_kinds("s3-unreachable,kill-rank"), 5, 30.0, Survivability(True, 4.0, **RGW))
    check_request(parse_kinds("kill-rank"), 5, 30.0, CAN)  # no store kind: no store needed


def test_a_job_is_waited_for_as_long_as_it_logs_and_given_up_once_it_stops(tmp_path: Path) -> None:
    """A long run is never cut for its length (a fixed cap killed a long soak's baseline half-way);
    a job whose log stops growing is. Real processes writing a real log."""
    log = tmp_path / "job.log"
    job = Job(tmp_path / "unused.yaml", 2, log, max_restarts=0)
    job.proc = subprocess.Popen(["sh", "-c", f"for i in 1 2 3 4; do echo step >> {log}; sleep 1; done"])
    assert job.wait(idle_s=2.5) == 0  # 4 s in all, longer than idle_s: it kept logging
    job.proc = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            job.wait(idle_s=2.0)
    finally:
        job.proc.kill()
        job.proc.wait()


def test_each_run_of_a_soak_gets_its_own_new_tier_0_directory(tmp_path: Path) -> None:
    """With tier 0 on, the baseline beside the faulted run must not share its slots, and no run may
    find an earlier soak's slots of the same run id (its first start would restore them)."""
    shm = tmp_path / "shm"
    overrides = ["checkpoint.memory.enabled=true", f"checkpoint.memory.dir={shm}"]
    runner = SoakRunner(SoakSettings(str(TINY), tmp_path / "soak", 20, overrides=overrides, data=tmp_path / "c"))
    runner.setup_memory()
    dirs = {
        name: yaml.safe_load(runner.config(name, 20).read_text())["checkpoint"]["memory"]["dir"]
        for name in ("baseline", "faulted")
    }
    assert dirs["baseline"] != dirs["faulted"] and all(d.startswith(f"{shm}/soak-") for d in dirs.values()), dirs
    Path(dirs["faulted"]).mkdir(parents=True)
    runner.teardown_memory()
    assert not Path(dirs["faulted"]).exists()
    again = SoakRunner(SoakSettings(str(TINY), tmp_path / "soak", 20, overrides=overrides, data=tmp_path / "c"))
    again.setup_memory()
    assert again.memory_root != runner.memory_root

"""``pretrain soak``: random faults at random moments against a 2-rank job under ft_launcher,
measured against the same steps run without faults, then one more restart (the second resume).

Order: refuse bad input (``pretrain.soak.schedule.check_request``), prepare a small synthetic
corpus, run the fault-free baseline, draw the schedule, run the faulted job with the faults injected
from outside (``pretrain.soak.runner``), restart it once more for ``SECOND_RESUME_STEPS`` steps, then
write ``soak-report.{md,json}`` and ``soak-timeline.png`` and print the headline figures
(``pretrain.soak.report``). Exit 0 only when every fault recovered, every logged loss equals the
baseline's, every attempt record names the fault injected and the second resume matched.
"""

from __future__ import annotations

import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any

from pretrain.observability.goodput import format_goodput, goodput_from_records
from pretrain.resilience.attempts import read_attempts
from pretrain.soak.report import build_report, losses_match, write_report
from pretrain.soak.runner import (
    END_MARGIN_STEPS,
    SECOND_RESUME_STEPS,
    FaultEvent,
    RunTimes,
    SoakRunner,
    SoakSettings,
    read_metrics,
)
from pretrain.soak.schedule import (
    KINDS,
    STORAGE_KINDS,
    STORE_KINDS,
    PlannedFault,
    SoakRequestError,
    Survivability,
    check_fits,
    check_request,
    draw_schedule,
    parse_kinds,
)
from pretrain.soak.storage import fuse_missing
from pretrain.soak.timeline import plot_timeline

# A restart of the tiny CPU job on a 2-core machine, by what the fault hits: after a rank or node
# fault the launcher restarts the group as forks of its standby process (fault -> next step
# 0.5-1 s); a job-level fault starts the launcher and its standby process again (their imports:
# 3-4 s). An MTTI below that means faults would arrive faster than the job can recover.
RESTART_S = {"rank": 1.0, "node": 1.0, "job": 4.0, "storage": 0.0, "store": 0.0}  # storage, store: no restart


def second_resume(runner: SoakRunner, steps: int, base_dir: Path, restarted: bool = True) -> dict[str, Any]:
    """One more restart after the soak's run ended: it must restore the last step (written by an
    attempt that was itself restored, when a fault of the run restarted it: ``restarted``; storage
    and store faults alone restart nothing) with its data position, and go on bit-equal to the baseline."""
    faulted = runner.run_dir("faulted")
    before = {a["id"] for a in read_attempts(faulted)}
    times = runner.plain_run("faulted", steps + SECOND_RESUME_STEPS, "second-resume.log")
    attempts = read_attempts(faulted)
    writer = next((a for a in reversed(attempts) if a["id"] in before and a.get("last_step") == steps), {})
    new = next((a for a in attempts if a["id"] not in before), {})
    rows = [r for r in read_metrics(faulted) if r["attempt"] == new.get("id")]
    gbs = runner.loaded().data.global_batch_size
    restored = (new.get("restored") or {}).get("step")
    compared, differ = losses_match(read_metrics(base_dir), rows)
    position_ok = bool(rows) and rows[0]["step"] == steps + 1 and rows[0]["consumed_samples"] == (steps + 1) * gbs
    passed = (
        times.rc == 0
        and restored == steps
        and (writer.get("restored") is not None or not restarted)
        and position_ok
        and not differ
        and len(rows) == SECOND_RESUME_STEPS
    )
    first = (rows[0]["step"], rows[0]["consumed_samples"]) if rows else (None, None)
    return {
        "passed": passed,
        "detail": (
            f"{'PASS' if passed else 'FAIL'}: restored step {restored} (written by attempt {writer.get('attempt')}, "
            f"itself restored from {(writer.get('restored') or {}).get('step')}); first step {first[0]} with "
            f"consumed_samples {first[1]} (want {(steps + 1) * gbs}); {compared} steps "
            + ("bit-equal to the baseline" if not differ else f"differ at {differ[:5]}")
        ),
    }


def check_data(prefix: str | None) -> Path | None:
    """``--data``: an existing Megatron indexed dataset (``PREFIX.bin`` and ``PREFIX.idx``), or None."""
    if prefix is None:
        return None
    path = Path(prefix).resolve()
    missing = [
        str(p) for p in (path.with_name(path.name + ".bin"), path.with_name(path.name + ".idx")) if not p.exists()
    ]
    if missing:
        raise SoakRequestError(
            f"soak: --data {prefix}: no indexed dataset there ({', '.join(missing)} missing); fix: pass the prefix "
            "pretrain prepare-data wrote (--output), or leave --data out for a synthetic corpus"
        )
    return path


def baseline_and_faulted(
    runner: SoakRunner, schedule: list[PlannedFault], alongside: bool
) -> tuple[RunTimes, tuple[RunTimes, list[FaultEvent], str | None]]:
    """The fault-free baseline, then the faulted run; ``alongside``: both at once (the faulted run
    idles through every detection and restart, so the pair ends sooner, but each then shares the
    machine with the other: the time-to-N-steps ratio is no longer a clean one)."""
    steps, kinds = runner.s.steps, ", ".join(p.kind for p in schedule)
    print(f"[soak] baseline: {runner.total_steps} steps without faults" + (" (alongside)" if alongside else ""))
    with ThreadPoolExecutor(max_workers=1) as pool:
        try:
            base = pool.submit(runner.plain_run, "baseline", runner.total_steps, "job.log", uploader=True)
            if not alongside:
                base.result()
            print(f"[soak] faulted run: {steps} steps, {len(schedule)} faults: {kinds}", flush=True)
            faulted = runner.faulted_run(schedule)
            return base.result(), faulted
        except BaseException:
            runner.stop_jobs()  # else leaving the pool would wait for the baseline to train to its end
            raise


def _exit_on_sigterm(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def run_soak(
    config: str | None,
    faults: int,
    mtti: float,
    seed: int,
    kinds_spec: str | None,
    workdir: str,
    steps: int,
    mtti_steps: float | None = None,
    alongside: bool = False,
    data: str | None = None,
    overrides: list[str] | None = None,
) -> int:
    # Stopped from outside (kill, a timeout): unwind, so that the finally blocks below and in the
    # runner stop the jobs, the uploader, the object store proxy and the mounts it started.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    kinds = parse_kinds(kinds_spec)
    work = Path(workdir).resolve()
    runner = SoakRunner(SoakSettings(config, work, steps, overrides=list(overrides or []), data=check_data(data)))
    cfg = runner.loaded()
    can = Survivability(
        cfg.checkpoint.replication.factor >= 2,
        max(RESTART_S[KINDS[k].target] for k in kinds),
        background_saves=cfg.checkpoint.async_.enabled,
        writer_process=cfg.checkpoint.async_.mode != "thread",  # auto is a writer process on CPU
        cannot_mount=fuse_missing() if set(kinds) & set(STORAGE_KINDS) else None,
        s3_uri=cfg.checkpoint.s3.uri,
        s3_endpoint=cfg.checkpoint.s3.endpoint_url,
    )
    check_request(kinds, faults, mtti, can, mtti_steps)
    in_steps = mtti_steps is not None
    schedule = draw_schedule(kinds, faults, mtti_steps or mtti, ranks=runner.s.nproc, seed=seed, in_steps=in_steps)
    check_fits(schedule, steps, END_MARGIN_STEPS)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    runner.prepare_data()
    try:
        runner.setup_memory()
        if set(kinds) & set(STORAGE_KINDS):
            runner.setup_storage()  # the faulted run's tier 1, kept for the second resume
        if cfg.checkpoint.s3.uri:  # a fresh prefix per run; the store kind's proxy, kept for the second resume
            runner.setup_store(cut=bool(set(kinds) & set(STORE_KINDS)))
        base, (times, events, stopped) = baseline_and_faulted(runner, schedule, alongside)
        restarted = any(KINDS[p.kind].restarts for p in schedule)
        resume = second_resume(runner, steps, runner.run_dir("baseline"), restarted)
    finally:
        runner.teardown_store()
        runner.teardown_storage()
        runner.teardown_memory()
    memory = cfg.checkpoint.memory
    interval = memory.interval if memory.enabled else cfg.checkpoint.local.interval  # the planner's interval
    report = build_report(
        runner.run_dir("baseline"), runner.run_dir("faulted"), base, times, events, faults, stopped, steps, resume,
        interval,
    )  # fmt: skip
    pace = f"{mtti_steps:g} steps" if in_steps else f"{mtti:g} s"
    head = write_report(work, report, runner.run_dir("faulted"), times.ended_at, seed, pace)
    plot_timeline(
        work / "soak-timeline.png", runner.run_dir("baseline"), base.launched_at, runner.run_dir("faulted"),
        times.launched_at, report["faults"],
    )  # fmt: skip
    for line in head:
        print(f"[soak] {line}", flush=True)
    print(format_goodput(goodput_from_records(runner.run_dir("baseline")), "[soak] goodput (fault-free baseline)"))
    print(f"[soak] {'PASS' if report['passed'] else 'FAIL'}: {work / 'soak-report.md'}", flush=True)
    return 0 if report["passed"] else 1

"""The soak's report: each fault against the run's own records, and the headline figures.

Reads the faulted run's attempt records, ``metrics.jsonl`` and restore events, the baseline's
``metrics.jsonl`` and the runner's :class:`~pretrain.soak.runner.FaultEvent` rows; writes
``soak-report.json``, ``soak-report.md`` and ``soak-timeline.png``. It never runs or signals anything.

Per fault: the attempt it hit and how that attempt's record classes it (:func:`recorded_class`,
compared with the class and ranks the kind must be recorded as: part of the soak's verdict),
detection (every process of the hit attempt gone), fault -> next step (the first step any later
attempt finished), the restored tier and step, and the lost steps. Headline: recovery-success rate,
every logged loss (recomputed steps included) bit-equal to the baseline, time to N steps against
the baseline, per kind detection and fault -> next step (median, p95), lost steps, goodput, and
the planner's goodput for the same measured costs (:mod:`pretrain.soak.projection`).

A storage kind (``blocked-write``, ``full-disk``) ends no attempt: its row is judged by the event
the job recorded it with (a tier-1 save failed or skipped, whose ``reason`` must be the kind's
``expect``), its detection is fault -> that event, its "next step" is fault -> tier 1 saving again
after the fault was released (the recovery), and it loses no step.

The store kind (``s3-unreachable``) ends no attempt either: its row is judged by the uploader's
``uploader_failures_total{reason="store"}`` going up after the store was cut (detection: fault ->
that) and by no attempt of the job starting while the store was cut or until the uploader
promoted a step newer than the one it had at the fault (its "next step": fault -> that promotion;
``back_s``: the store answering again -> that promotion).
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pretrain.observability.goodput import format_goodput, goodput_from_records
from pretrain.observability.runlog import read_jsonl
from pretrain.resilience.attempts import read_attempts
from pretrain.soak.projection import planner_projection, projection_line
from pretrain.soak.runner import FaultEvent, RunTimes, read_metrics, write_json
from pretrain.soak.schedule import KINDS

COMPARED = ("loss", "grad_norm", "lr")
# Fault -> next step, in order: the launcher finding the fault and tearing the group down; starting
# the new processes (the soak's relaunch too, for a job-level fault); the interpreter, imports and
# process group; model and optimizer build; the restore; the first step.
BREAKDOWN = ("detection", "launcher_restart", "startup_imports_pg", "build", "restore", "first_step")


def recorded_class(rec: dict[str, Any]) -> str:
    """How an attempt record names what ended it: killed, hang, signal-N, exception, preempted, ..."""
    if rec.get("status") == "preempted":
        return "preempted"
    failure = rec.get("failure") or {}
    evidence = failure.get("evidence") or ""
    if "killed by signal " in evidence:
        return "signal-" + evidence.split("killed by signal ")[1].split()[0]
    if " hung:" in evidence:
        return "hang"
    if failure.get("classification") == "user":
        return "exception"
    if "ended without a report" in evidence or "injected SIGKILL" in evidence:
        return "killed"
    return str(failure.get("classification") or rec.get("status"))


def recorded_ranks(rec: dict[str, Any]) -> list[int]:
    failure = rec.get("failure") or {}
    ranks = failure.get("ranks")
    if ranks is None and failure.get("rank") is not None:
        ranks = [failure["rank"]]
    return sorted(ranks or [])


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of a small sample; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def fault_row(
    event: FaultEvent,
    attempts: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    restores: list[dict[str, Any]],
    t0: float,
) -> dict[str, Any]:
    kind = KINDS[event.plan.kind]
    t = event.injected.time
    if kind.target == "storage":
        return _storage_row(event, t0)
    if kind.target == "store":
        return _store_row(event, attempts, rows, t0)
    hit = next((a for a in attempts if a.get("id") == event.attempt), {})
    later = [a for a in attempts if (a.get("started_at") or 0) > t and a.get("first_step") is not None]
    nxt = later[0] if later else {}
    first_next = next((r for r in rows if r["time"] > t and r["attempt"] != event.attempt), None)
    restore = next((e for e in restores if e.get("attempt") == nxt.get("id")), {})
    nxt_first = next((r for r in rows if r["attempt"] == nxt.get("id")), None)
    got_class, got_ranks = recorded_class(hit), recorded_ranks(hit)
    want_ranks = sorted(event.injected.ranks)
    ranks_ok = kind.expect == "preempted" or got_ranks == want_ranks
    row: dict[str, Any] = {
        "index": event.plan.index + 1,
        "kind": event.plan.kind,
        "ranks": want_ranks,
        "at_s": round(t - t0, 3),
        "gap_s": event.plan.gap_s,
        "gap_steps": event.plan.gap_steps,
        "attempt_hit": event.attempt,
        "recorded_class": got_class,
        "expected_class": kind.expect,
        "recorded_ranks": got_ranks,
        "record_matches": got_class == kind.expect and ranks_ok,
        "evidence": (hit.get("failure") or {}).get("evidence") or hit.get("status"),
        "detection_s": round(event.gone_at - t, 3) if event.gone_at else None,
        "fault_to_next_step_s": round(first_next["time"] - t, 3) if first_next else None,
        # a later attempt finished a step, or ended the run having restored its last step
        "recovered": first_next is not None
        or any(
            (a.get("started_at") or 0) > t and a.get("status") == "succeeded" and a.get("restored") for a in attempts
        ),
        "breakdown_s": recovery_breakdown(t, event.gone_at, nxt, restore, nxt_first),
        "restored": nxt.get("restored"),
        "lost_steps": nxt.get("lost_steps"),
        "detail": event.injected.detail,
    }
    if event.plan.kind == "corrupt-kill" and event.injected.detail.get("step") is not None:
        flipped = event.injected.detail["step"]
        row["flipped_copy_rejected"] = any(r.get("step") == flipped for r in restore.get("rejected", []))
    return row


def _storage_row(event: FaultEvent, t0: float) -> dict[str, Any]:
    """A storage fault's row (see the module docstring): same columns as a process fault's."""
    kind, t, rec = KINDS[event.plan.kind], event.injected.time, event.recorded or {}
    got = str(rec.get("reason")) if rec else "not recorded"
    return {
        "index": event.plan.index + 1,
        "kind": event.plan.kind,
        "ranks": sorted(event.injected.ranks),
        "at_s": round(t - t0, 3),
        "gap_s": event.plan.gap_s,
        "gap_steps": event.plan.gap_steps,
        "attempt_hit": event.attempt,
        "recorded_class": got,
        "expected_class": kind.expect,
        "recorded_ranks": sorted(event.injected.ranks) if rec else [],
        "record_matches": got == kind.expect,
        "evidence": f"{rec.get('event')} of step {rec.get('step')}: {rec.get('error')}" if rec else None,
        "detection_s": round(event.gone_at - t, 3) if event.gone_at else None,
        "fault_to_next_step_s": round(event.recovered_at - t, 3) if event.recovered_at else None,
        "recovered": event.recovered_at is not None,
        "breakdown_s": None,
        "restored": None,
        "lost_steps": 0,
        "detail": event.injected.detail,
    }


def _store_row(
    event: FaultEvent, attempts: list[dict[str, Any]], rows: list[dict[str, Any]], t0: float
) -> dict[str, Any]:
    """A store fault's row (see the module docstring): a storage row, judged by the uploader's
    failure counter, and failed when the job started an attempt while the store was cut or not back.
    ``steps_trained_while_cut``: training went on meanwhile."""
    row = _storage_row(event, t0)
    t, rec = event.injected.time, event.recorded or {}
    until = event.recovered_at or event.released_at or t
    restarted = [a["id"] for a in attempts if t < (a.get("started_at") or 0) <= until]
    released, back = event.released_at, event.recovered_at
    trained = sum(1 for r in rows if t < r["time"] <= (released or t))
    outage_s = round(released - t, 3) if released else None
    back_s = round(back - released, 3) if back and released else None
    evidence = None
    if rec:
        before, after = rec["uploader_failures_total"]
        evidence = (
            f'uploader_failures_total{{reason="store"}} {before:g} -> {after:g}; store cut {outage_s} s '
            f"({trained} steps trained meanwhile); promoted "
            f"step {rec.get('promoted_step_at_fault')} at the fault, {rec.get('promoted_step_after')} {back_s} s "
            "after the store answered again; "
            + (f"attempts started meanwhile: {restarted}" if restarted else "no attempt started meanwhile")
        )
    row.update(
        recorded_ranks=[],
        record_matches=row["record_matches"] and not restarted,
        evidence=evidence,
        restarted_during=restarted,
        steps_trained_while_cut=trained,
        outage_s=outage_s,
        back_s=back_s,
    )
    return row


def recovery_breakdown(
    fault_at: float,
    gone_at: float | None,
    nxt: dict[str, Any],
    restore: dict[str, Any],
    first_row: dict[str, Any] | None,
) -> dict[str, float] | None:
    """Where the seconds from a fault to the next attempt's first step went, from boundaries the
    records already hold: every process of the hit attempt gone (the runner), the new rank process's
    start (``process_started_at``), its attempt record opened after the process group formed
    (``started_at``), the restore's end and length (its ``restore`` event; a ``fresh_start`` event
    when there was nothing to restore) and the first step's row. The parts add up to fault -> next
    step; None when a boundary is missing (the fault hit the last steps)."""
    ends = [gone_at, nxt.get("process_started_at"), nxt.get("started_at"), restore.get("time")]
    if first_row is None or None in ends:
        return None
    gone, proc, opened, restored = (float(e or 0.0) for e in ends)
    restore_s = float(restore.get("seconds") or 0.0)
    marks = [fault_at, gone, proc, opened, restored - restore_s, restored, float(first_row["time"])]
    return {part: round(b - a, 3) for part, a, b in zip(BREAKDOWN, marks, marks[1:], strict=False)}


def losses_match(base: list[dict[str, Any]], faulted: list[dict[str, Any]]) -> tuple[int, list[int]]:
    """(rows compared, steps whose loss, grad norm or LR differ from the baseline's, bit for bit)."""
    want = {r["step"]: r for r in base}
    bad = [r["step"] for r in faulted if r["step"] not in want or any(r[k] != want[r["step"]][k] for k in COMPARED)]
    return len(faulted), bad


def _per_kind(rows: list[dict[str, Any]], key: str) -> dict[str, dict[str, float | None]]:
    out = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        vals = [r[key] for r in rows if r["kind"] == kind and r[key] is not None]
        out[kind] = {"n": len(vals), "median": percentile(vals, 50), "p95": percentile(vals, 95)}
    return out


def _breakdown_medians(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind, and over every fault ("all"): how many faults had a breakdown, each part's median."""
    out: dict[str, dict[str, Any]] = {}
    for kind in ["all", *dict.fromkeys(r["kind"] for r in rows)]:
        parts = [r["breakdown_s"] for r in rows if r["breakdown_s"] and kind in ("all", r["kind"])]
        out[kind] = {"n": len(parts), **{p: percentile([b[p] for b in parts], 50) for p in BREAKDOWN}}
    return out


def unplanned_restarts(attempts: list[dict[str, Any]], events: list[FaultEvent]) -> list[dict[str, Any]]:
    """Attempts that failed although no fault was injected into them (a hang timeout a loaded
    machine's slow step ran into, say), with what their records say. Shown, not failed: the
    injected faults are what the soak judges, and these are what a user would ask about next."""
    hit = {e.attempt for e in events}
    return [
        {"attempt": a["id"], "last_step": a.get("last_step"), "evidence": (a.get("failure") or {}).get("evidence")}
        for a in attempts
        if a.get("status") not in ("succeeded", "running", None) and a.get("id") not in hit
    ]


def build_report(
    base_dir: Path,
    faulted_dir: Path,
    base_times: RunTimes,
    faulted_times: RunTimes,
    events: list[FaultEvent],
    planned: int,
    stopped: str | None,
    steps: int,
    second_resume: dict[str, Any],
    interval_steps: int,
) -> dict[str, Any]:
    """``interval_steps``: the steps between saves of the nearest tier that survives a process
    fault (the planner's interval, see :mod:`pretrain.soak.projection`)."""
    # the faulted run's attempts and rows only: the second resume appends to the same records afterwards
    attempts = [a for a in read_attempts(faulted_dir) if (a.get("started_at") or 0) <= faulted_times.ended_at]
    rows = [r for r in read_metrics(faulted_dir) if r["time"] <= faulted_times.ended_at]
    base_rows = read_metrics(base_dir)
    # restores, and fresh starts (an attempt with nothing to restore): where each attempt's build ended
    restores = [e for e in read_jsonl(faulted_dir / "events.jsonl") if e.get("event") in ("restore", "fresh_start")]
    faults = [fault_row(e, attempts, rows, restores, faulted_times.launched_at) for e in events]
    compared, differ = losses_match(base_rows, rows)
    reached = max((r["step"] for r in rows), default=0)
    base_at_n = next((r["time"] for r in base_rows if r["step"] == steps), None)
    base_wall = (base_at_n - base_times.launched_at) if base_at_n else None
    faulted_wall = faulted_times.ended_at - faulted_times.launched_at
    recovered = sum(1 for f in faults if f["recovered"])
    lost = [f["lost_steps"] for f in faults if f["lost_steps"] is not None]
    mismatches = [f["index"] for f in faults if not f["record_matches"]]
    headline = {
        "faults_planned": planned,
        "faults_injected": len(faults),
        "kinds_injected": sorted({f["kind"] for f in faults}),
        "stopped_early": stopped,
        "recovery_success_rate": recovered / len(faults) if faults else None,
        "run_completed": faulted_times.rc == 0 and reached == steps,
        "losses_compared": compared,
        "losses_bit_equal": not differ and compared > 0,
        "loss_mismatch_steps": differ[:20],
        "time_to_n_steps_ratio": faulted_wall / base_wall if base_wall else None,
        "faulted_wall_s": round(faulted_wall, 2),
        "baseline_wall_to_n_s": round(base_wall, 2) if base_wall else None,
        "record_mismatches": mismatches,
        "lost_steps_per_fault": {"mean": sum(lost) / len(lost) if lost else None, "max": max(lost, default=None)},
        "detection_s": _per_kind(faults, "detection_s"),
        "fault_to_next_step_s": _per_kind(faults, "fault_to_next_step_s"),
        "recovery_breakdown_median_s": _breakdown_medians(faults),
        "second_resume": second_resume,
        "unplanned_restarts": unplanned_restarts(attempts, events),
    }
    ok = (
        bool(faults)
        and headline["recovery_success_rate"] == 1.0
        and headline["run_completed"]
        and headline["losses_bit_equal"]
        and not mismatches
        and second_resume.get("passed", False)
    )
    report = {
        "passed": ok,
        "headline": headline,
        "faults": faults,
        "goodput": {
            "faulted": goodput_from_records(faulted_dir, until=faulted_times.ended_at).to_dict(),
            "baseline": goodput_from_records(base_dir).to_dict(),
        },
        "events": [asdict(e) for e in events],
    }
    report["goodput"]["planner_projection"] = planner_projection(report, interval_steps)
    return report


def headline_lines(report: dict[str, Any], faulted_dir: Path, until: float) -> list[str]:
    h = report["headline"]
    lost = h["lost_steps_per_fault"]
    rate = h["recovery_success_rate"]
    ratio = h["time_to_n_steps_ratio"]
    lines = [
        f"faults injected      : {h['faults_injected']} of {h['faults_planned']} ({len(h['kinds_injected'])} kinds: "
        f"{', '.join(h['kinds_injected'])})" + (f"; stopped early: {h['stopped_early']}" if h["stopped_early"] else ""),
        f"recovery success     : {rate:.0%}" if rate is not None else "recovery success     : -",
        f"run completed        : {h['run_completed']}",
        f"losses bit-equal     : {h['losses_bit_equal']} ({h['losses_compared']} logged steps compared, recomputed "
        "ones included)" + (f"; differ at {h['loss_mismatch_steps']}" if h["loss_mismatch_steps"] else ""),
        f"time to N steps      : {ratio:.2f} x fault-free ({h['faulted_wall_s']} s against "
        f"{h['baseline_wall_to_n_s']} s)"
        if ratio
        else "time to N steps      : -",
        f"records vs injected  : {len(h['record_mismatches'])} mismatches {h['record_mismatches'] or ''}",
        f"unplanned restarts   : {len(h['unplanned_restarts'])}"
        + "".join(f"; {u['attempt']} after step {u['last_step']}: {u['evidence']}" for u in h["unplanned_restarts"]),
        f"lost steps per fault : mean {_fmt(lost['mean'])}, max {lost['max']}",
        f"second resume        : {h['second_resume'].get('detail')}",
        "per kind (median / p95 s): detection | fault -> next step",
    ]
    for kind, det in h["detection_s"].items():
        nxt = h["fault_to_next_step_s"].get(kind, {})
        lines.append(
            f"  {kind:<13} n={det['n']}  {_fmt(det['median'])} / {_fmt(det['p95'])} | "
            f"{_fmt(nxt.get('median'))} / {_fmt(nxt.get('p95'))}"
        )
    lines.append("fault -> next step, median s: " + " | ".join(BREAKDOWN))
    for kind, med in h["recovery_breakdown_median_s"].items():
        lines.append(f"  {kind:<13} n={med['n']}  " + " | ".join(_fmt(med[p]) for p in BREAKDOWN))
    g = goodput_from_records(faulted_dir, until=until)
    lines.append(format_goodput(g, "goodput (faulted run, from its records)"))
    if "planner_projection" in report["goodput"]:
        lines.append(projection_line(report["goodput"]["planner_projection"]))
    return lines


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def write_report(
    work: Path, report: dict[str, Any], faulted_dir: Path, faulted_end: float, seed: int, mtti: str
) -> list[str]:
    write_json(work / "soak-report.json", report)
    head = headline_lines(report, faulted_dir, faulted_end)
    lines = [
        "# Soak report",
        "",
        f"Random faults (seed {seed}, exponential gaps at an MTTI of {mtti} after each recovery) against a "
        "2-rank CPU job under ft_launcher, compared with the same steps run without faults.",
        "",
        f"Result: **{'PASS' if report['passed'] else 'FAIL'}**",
        "",
        "```",
        *head,
        "```",
        "",
        "| # | kind | ranks | at s | recorded as | expected | match | detection s | fault -> next step s | restored | "
        "lost steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in report["faults"]:
        restored = f"{f['restored']['tier']}@{f['restored']['step']}" if f.get("restored") else "-"
        lines.append(
            f"| {f['index']} | {f['kind']} | {f['ranks']} | {f['at_s']} | "
            f"{f['recorded_class']} {f['recorded_ranks']} | "
            f"{f['expected_class']} | {'yes' if f['record_matches'] else 'NO'} | {f['detection_s']} | "
            f"{f['fault_to_next_step_s']} | {restored} | {f['lost_steps']} |"
        )
    lines += ["", "Evidence recorded per fault:", ""]
    lines += [f"{f['index']}. {f['kind']}: {str(f['evidence']).replace('|', '/')}" for f in report["faults"]]
    (work / "soak-report.md").write_text("\n".join(lines) + "\n")
    return head

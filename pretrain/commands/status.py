"""``pretrain status``: one line per attempt of a run, from ``attempts/attempt-NN.json``."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from pretrain.resilience.attempts import diagnose, needs_diagnosis, read_attempts


def _when(ts: float | None) -> str:
    if not ts:
        return "-"
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _restarts(rec: dict[str, Any]) -> str:
    parts = [f"launcher {rec.get('launcher_restart_count', 0)}"]
    if "slurm_restart_count" in rec:
        parts.append(f"slurm {rec['slurm_restart_count']}")
    if "pod_restart_count" in rec:
        parts.append(f"pod {rec['pod_restart_count']}")
    return ", ".join(parts)


def attempt_rows(run_dir: Path) -> list[dict[str, Any]]:
    """Records with an on-the-fly diagnosis for an attempt nobody closed (e.g. the last one died)."""
    rows = read_attempts(run_dir)
    for i, rec in enumerate(rows):
        if rec.get("status") == "unreadable":
            continue
        if needs_diagnosis(rec) and (i < len(rows) - 1 or rec.get("status") == "failed"):
            rec = {**rec, "failure": diagnose(run_dir, rec), "status": "failed (diagnosed)"}
            rows[i] = rec
    return rows


def format_status(run_dir: Path) -> str:
    rows = attempt_rows(run_dir)
    if not rows:
        return f"{run_dir}: no attempt records (attempts/attempt-NN.json); is this <run.dir>/<run.id>?"
    lines = [f"run {run_dir.name}: {len(rows)} attempt(s)"]
    lines.append(
        f"{'#':>3}  {'status':<18} {'started (UTC)':<19} {'steps':<11} {'restored':<14} {'lost':>4} {'RTO s':>6}"
        "  restarts / failure"
    )
    for rec in rows:
        if rec.get("status") == "unreadable":
            lines.append(f"  ?  unreadable: {rec['error']}")
            continue
        restored = rec.get("restored")
        where = f"{restored['tier']}@{restored['step']}" if restored else "fresh"
        steps = f"{rec.get('first_step') or '-'}..{rec.get('last_step') or '-'}"
        lost = rec.get("lost_steps")
        rto = rec.get("rto_seconds")
        tail = _restarts(rec)
        failure = rec.get("failure")
        if failure:
            who = f"rank {failure.get('rank')}" if failure.get("rank") is not None else "rank ?"
            what = failure.get("exception") or failure.get("evidence") or ""
            tail += f" | {failure.get('classification')}: {who}: {what}"
        if rec.get("emergency"):
            tail += f" | {rec['emergency']}"
        lines.append(
            f"{rec['attempt']:>3}  {rec['status']:<18} {_when(rec.get('started_at')):<19} {steps:<11} {where:<14} "
            f"{'-' if lost is None else lost:>4} {'-' if rto is None else f'{rto:.1f}':>6}  {tail}"
        )
    return "\n".join(lines + agent_lines(run_dir))


def agent_lines(run_dir: Path) -> list[str]:
    """One line per node's checkpoint agent, from ``agents/<host>.json`` (what it last wrote)."""
    out = []
    for path in sorted((run_dir / "agents").glob("*.json")):
        try:
            body = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            out.append(f"agent {path.stem}: unreadable status {path}: {exc}")
            continue
        newest = {r: (v.get("persisted") or ["-"])[0] for r, v in sorted(body.get("ranks", {}).items())}
        current = body.get("current")
        busy = f"persisting rank {current['rank']} step {current['step']}" if current else "idle"
        if current and body.get("current_since"):
            busy += f" for {max(0.0, body['updated'] - body['current_since']):.1f}s"
        out.append(
            f"agent {body.get('host', path.stem)} (pid {body.get('pid')}, at {_when(body.get('updated'))}): {busy}; "
            f"queued {body.get('queued', [])}; newest tier-1 step by rank {newest}"
            + (f"; last error: {body['last_error']}" if body.get("last_error") else "")
        )
    return out


def status_json(run_dir: Path) -> str:
    return json.dumps(attempt_rows(run_dir), indent=2, sort_keys=True)

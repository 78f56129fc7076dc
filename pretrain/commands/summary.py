"""Recovery summary from a run's ``events.jsonl`` and ``metrics.jsonl``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pretrain.observability.runlog import read_jsonl


@dataclass
class Recovery:
    failure_step: int
    restored_step: int | None
    restored_tier: str | None
    lost_steps: int
    restore_seconds: float | None
    failure_to_first_step_seconds: float | None


@dataclass
class RunReport:
    final_step: int
    attempts: int
    recoveries: list[Recovery]
    steps_per_second_by_attempt: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rate(rows: list[dict[str, Any]]) -> float:
    if len(rows) < 2:
        return 0.0
    span = rows[-1]["time"] - rows[0]["time"]
    return (len(rows) - 1) / span if span > 0 else 0.0


def summarize(run_dir: Path) -> RunReport:
    events = read_jsonl(run_dir / "events.jsonl")
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m.get("kind", "train") == "train"]
    attempts: list[str] = []
    for e in events:
        if e["event"] == "start" and e["attempt"] not in attempts:
            attempts.append(e["attempt"])
    by_attempt = {a: [m for m in metrics if m["attempt"] == a] for a in attempts}
    recoveries = []
    for i, e in enumerate(events):
        if e["event"] != "fault_injected" and e["event"] != "failure":
            continue
        later_attempts = attempts[attempts.index(e["attempt"]) + 1 :] if e["attempt"] in attempts else []
        nxt = later_attempts[0] if later_attempts else None
        restore = next((r for r in events[i:] if r["event"] == "restore" and r["attempt"] == nxt), None)
        done = [m["step"] for m in by_attempt.get(e["attempt"], []) if m["step"] < e["step"]]
        last_done = max(done) if done else e["step"] - 1
        restored_step = restore["step"] if restore else None
        first = by_attempt.get(nxt, []) if nxt else []
        recoveries.append(
            Recovery(
                failure_step=e["step"],
                restored_step=restored_step,
                restored_tier=restore["tier"] if restore else None,
                lost_steps=last_done - (restored_step or 0),
                restore_seconds=restore["seconds"] if restore else None,
                failure_to_first_step_seconds=(first[0]["time"] - e["time"]) if first else None,
            )
        )
    final = max((m["step"] for m in metrics), default=0)
    return RunReport(final, len(attempts), recoveries, {a: round(_rate(rows), 2) for a, rows in by_attempt.items()})


def format_report(report: RunReport) -> str:
    lines = ["recovery summary", "----------------"]
    lines.append(f"final step reached          : {report.final_step}")
    lines.append(f"attempts                    : {report.attempts}")
    rates = list(report.steps_per_second_by_attempt.values())
    for r in report.recoveries:
        lines.append(f"failure at step             : {r.failure_step}")
        lines.append(f"checkpoint step restored    : {r.restored_step} (tier {r.restored_tier})")
        lines.append(f"lost steps (recomputed)     : {r.lost_steps}")
        if r.restore_seconds is not None:
            lines.append(f"restore seconds             : {r.restore_seconds:.2f}")
        if r.failure_to_first_step_seconds is not None:
            lines.append(f"failure -> next step (RTO)  : {r.failure_to_first_step_seconds:.2f} s")
    if rates:
        lines.append(f"steps/s before failure      : {rates[0]:.2f}")
    if len(rates) > 1:
        lines.append(f"steps/s after recovery      : {rates[-1]:.2f}")
    return "\n".join(lines)

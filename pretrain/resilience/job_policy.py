"""When to stop retrying: the restart budget of the launchers is for failures a restart can fix.

* A deterministic failure (classification ``user`` or ``data``) is retried once; when the next
  attempt fails with the same signature it is *confirmed* and the job stops.
* ``fault_tolerance.max_consecutive_failures_without_progress`` attempts in a row that failed the
  same way (same classification and failure, at the same last step) without committing a step
  newer than the one they restored stop the job too: restarting from the same point again would
  only repeat them. Failures that differ (a rank killed while restoring, then another during the
  first steps) are faults from outside, not the code repeating itself: the launcher's restart
  budget bounds them, and a run with an intact checkpoint is never stopped for them.

Stopping writes ``attempts/STOP.json`` (the durable decision: ``pretrain launch`` refuses to start
while it exists, so Slurm requeues and pod restarts do not loop either) and ends the local
``ft_launcher``: NVRx 0.4.1 has no exit code that stops its restarts, so the worker sends SIGTERM to
its launcher (its parent process), which stops the local workers and exits.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from pretrain.errors import JobStopped
from pretrain.resilience.attempts import attempts_dir, write_json_atomic
from pretrain.resilience.failures import Classification, FailureInfo
from pretrain.resilience.standby.wire import AGENT_ENV

log = logging.getLogger(__name__)

STOP_FILE = "STOP.json"
DETERMINISTIC = (Classification.USER.value, Classification.DATA.value)


def stop_path(run_dir: Path) -> Path:
    return attempts_dir(run_dir) / STOP_FILE


def read_stop(run_dir: Path) -> dict[str, Any] | None:
    path = stop_path(run_dir)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        return {"reason": f"unreadable stop marker ({exc})"}


def refuse_if_stopped(run_dir: Path) -> None:
    """Raise JobStopped if an earlier attempt stopped this run."""
    stop = read_stop(run_dir)
    if stop is not None:
        raise JobStopped(
            f"{stop_path(run_dir)}: this run was stopped: {stop.get('reason')}; fix: fix the cause, then delete "
            "that file to allow restarts"
        )


def write_stop(run_dir: Path, reason: str, **details: Any) -> None:
    path = stop_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"reason": reason, "time": time.time(), **details})


def signature(failure: dict[str, Any] | None) -> str | None:
    if not failure or failure.get("classification") not in DETERMINISTIC or not failure.get("exception"):
        return None
    return f"{failure['classification']}:{failure['exception']}"


def confirmed_deterministic(info: FailureInfo, previous_failure: dict[str, Any] | None) -> bool:
    """This failure is deterministic and the previous attempt failed identically."""
    return info.classification in DETERMINISTIC and signature(previous_failure) == info.signature


def _progressed(rec: dict[str, Any]) -> bool:
    restored = (rec.get("restored") or {}).get("step") or 0
    saved = max((v for k, v in rec.items() if k.startswith("last_saved_") and isinstance(v, int)), default=-1)
    return saved > restored


def _failure_point(rec: dict[str, Any]) -> tuple[Any, ...]:
    """What must match for two failed attempts to count as the same failure repeating."""
    failure = rec.get("failure") or {}
    return (
        failure.get("classification"),
        tuple(failure.get("ranks") or [failure.get("rank")]),
        failure.get("exception") or failure.get("evidence"),
        rec.get("last_step"),
    )


def failures_without_progress(history: list[dict[str, Any]]) -> int:
    """Trailing attempts that failed (not preempted) the same way without committing a step past
    their restore."""
    count, point = 0, None
    for rec in reversed(history):
        if rec.get("status") != "failed" or _progressed(rec):
            break
        if point is not None and _failure_point(rec) != point:
            break
        point = _failure_point(rec)
        count += 1
    return count


def stop_local_launcher() -> None:
    """SIGTERM the elastic agent that started this worker (ft_launcher/torchrun), if there is one."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return
    # A rank forked by a standby server has the server as its parent; its client names the launcher.
    parent = int(os.environ.get(AGENT_ENV, os.getppid()))
    if parent > 1:
        log.error("stopping the launcher (pid %d) so that it does not restart a failure that would repeat", parent)
        with contextlib.suppress(OSError):
            os.kill(parent, signal.SIGTERM)

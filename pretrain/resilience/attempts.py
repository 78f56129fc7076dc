"""Attempt records: ``<run.dir>/<run.id>/attempts/attempt-NN.json``, one file per attempt.

Rank 0 creates the next free number with ``O_EXCL`` when an attempt starts, so a later attempt
never overwrites an earlier record, and rewrites only its own file (atomically: temp + rename)
as the attempt restores, takes its first step, saves and ends. A killed attempt cannot close its
own record; the next attempt does, from the evidence the dead one left behind:

* ``attempts/failures/<attempt id>.rank-NNNNN.json``: what a rank that caught an exception (or a
  preemption signal) knew when it went down (:func:`record_failure`);
* ``events.jsonl`` ``fault_injected`` lines (drills);
* the tail of ``metrics.jsonl`` for the last step the attempt finished and when.

A record's ``scaled`` says when the attempt runs on another number of nodes or ranks than the one
before it (``{from_nodes, to_nodes, from_world_size, to_world_size}``; None otherwise).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from pretrain.platform.procfs import START_TICKS, stat_fields
from pretrain.resilience.failures import Classification, FailureInfo
from pretrain.resilience.phases import PULSE_S, fatal_signal, ranks_dir, read_phases, record_of
from tiering.system.fsio import atomic_write_bytes

log = logging.getLogger(__name__)
# A rank whose pulse stopped this long before every other rank's hung (a kill is seen by its peers
# at once; a hang only when the launcher's heartbeat or section timeout runs out). Outside the
# training steps a killed rank's peers may go on for 2 s before they notice (seen in start-up and
# in an emergency save), and hangs there wait for the setup or checkpointing timeout (minutes).
HUNG_GAP_S = 3.0
# In training a killed rank's peers notice within a step (their next collective fails), while a
# hang is found by the measured step timeout: the slowest step x the safety factor (20), about
# 1-2 s for the tiny config running alone, where every rank's monitor kills its blocked rank at
# once, so the peers' pulses outlive the hung one's by that timeout only (3 s read two hangs of a
# long soak as "every rank ended without a report"); 1 s read a kill as a hang on a loaded machine,
# where the survivor reached its next collective 1.1 s after the kill.
HUNG_GAP_TRAINING_S = 1.5

ATTEMPT_GLOB = "attempt-*.json"
_TAIL_BYTES = 1 << 20


def attempts_dir(run_dir: Path) -> Path:
    return run_dir / "attempts"


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Readers see the old record or the new one (a unique temp name per call: the preemption
    watchdog thread and the training thread may both write the attempt record)."""
    atomic_write_bytes(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


def read_attempts(run_dir: Path) -> list[dict[str, Any]]:
    """Every attempt record of a run, oldest first; unreadable files are reported, not skipped silently."""
    out = []
    for path in sorted(attempts_dir(run_dir).glob(ATTEMPT_GLOB)):
        try:
            out.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError) as exc:
            out.append({"attempt": path.stem, "status": "unreadable", "error": f"{path}: {exc}"})
    return out


def record_failure(run_dir: Path, attempt_id: str, rank: int, info: FailureInfo) -> None:
    """Any rank: leave evidence of how this rank's attempt ended (best effort, never raises)."""
    try:
        d = attempts_dir(run_dir) / "failures"
        d.mkdir(parents=True, exist_ok=True)
        write_json_atomic(
            d / f"{attempt_id}.rank-{rank:05d}.json",
            {
                "attempt_id": attempt_id,
                "rank": rank,
                "host": socket.gethostname(),
                "time": time.time(),
                **info.to_dict(),
            },
        )
    except OSError as exc:  # the rank is failing anyway; the next attempt names it "without a report"
        log.warning("rank %d: could not write its failure report under %s: %s", rank, run_dir, exc)


def _process_start() -> float:
    """This process's start on the ``time.time()`` clock every other record uses, to a clock tick:
    the kernel's start tick (``/proc/self/stat``) against ``CLOCK_BOOTTIME``. psutil's
    ``create_time`` adds that tick to ``/proc/stat``'s boot time, truncated to a whole second, so it
    reads up to a second early: a restarted attempt then seemed to start before the last one ended."""
    try:
        ticks = int(stat_fields(Path("/proc/self/stat"))[START_TICKS])
    except (OSError, ValueError, IndexError):  # not Linux: psutil's figure, a second coarse
        import psutil  # deferred: only where /proc is missing

        return psutil.Process().create_time()
    since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - since_start


def scaled_from(earlier: list[dict[str, Any]], hosts: list[str], world_size: int) -> dict[str, int] | None:
    """``{from_nodes, to_nodes, from_world_size, to_world_size}`` when an attempt on ``hosts`` runs on
    another number of nodes or ranks than the last earlier attempt that recorded its hosts (a
    scale-down after a node loss, or back up); None for the first attempt or the same size."""
    last = next((rec for rec in reversed(earlier) if rec.get("hosts")), None)
    if last is None:
        return None
    before, now = len(last["hosts"]), len(set(hosts))
    if before == now and last.get("world_size") == world_size:
        return None
    previous_world = int(last.get("world_size", 0))
    return {"from_nodes": before, "to_nodes": now, "from_world_size": previous_world, "to_world_size": world_size}


def _last_progress(run_dir: Path, attempt_id: str) -> tuple[int | None, float | None]:
    """(last finished step, its time) of an attempt, from the tail of metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - _TAIL_BYTES))
            tail = f.read().decode("utf-8", errors="replace")
    except OSError:
        return None, None
    step, when = None, None
    for line in tail.splitlines():
        if f'"{attempt_id}"' not in line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("attempt") == attempt_id:
            step, when = row["step"], row["time"]
    return step, when


def _injected_faults(run_dir: Path, attempt_id: str) -> list[dict[str, Any]]:
    return [row for row in _run_events(run_dir, "fault_injected") if row.get("attempt") == attempt_id]


def _run_events(run_dir: Path, name: str) -> list[dict[str, Any]]:
    """The run's ``name`` events (``events.jsonl``), in the order written; unreadable lines skipped."""
    try:
        lines = (run_dir / "events.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        if name not in line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and row.get("event") == name:
            out.append(row)
    return out


def _watch_kills(run_dir: Path, pids: dict[int, int]) -> dict[int, float]:
    """Ranks of ``pids`` (rank -> the pid of this attempt's process) that the node's hang watch
    killed (``hang_killed`` events naming that process): rank -> the seconds it was silent."""
    return {
        int(row["rank"]): float(row.get("stale_s", 0.0))
        for row in _run_events(run_dir, "hang_killed")
        if pids.get(row.get("rank", -1)) == row.get("pid")
    }


def _lost_node(
    run_dir: Path, attempt: str | None, silent: list[int], where: dict[int, str], reports: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """The first node the node liveness found lost in ``attempt`` (``node_lost`` events), as the
    attempt's failure: the silent ranks it did not kill were the lost node's. None without one."""
    lost = [e for e in _run_events(run_dir, "node_lost") if e.get("attempt") == attempt]
    if not lost:
        return None
    # In a partition each side finds the other lost: name a node whose finder was not itself
    # reported lost (the nodes' clocks may differ by more than the events' spacing).
    reported = {e.get("node") for e in lost}
    first = min([e for e in lost if e.get("seen_by") not in reported] or lost, key=lambda e: e.get("time", 0.0))
    killed = {r for e in lost for r in e.get("killed_ranks", [])}
    ranks = [r for r in silent if r not in killed] or silent
    how = f"no beat for {first['silent_s']}s" if first.get("silent_s") is not None else "reported lost"
    return {
        "rank": ranks[0],
        "ranks": ranks,
        "exit_code": None,
        "exception": None,
        "classification": Classification.INFRASTRUCTURE.value,
        "evidence": f"node {first.get('node')} lost: {how} (seen by {first.get('seen_by')}); "
        f"ranks {sorted(killed)} stopped by the node liveness",
        "phases": {str(r): p for r, p in where.items()},
        "reports": len(reports),
    }


def diagnose(run_dir: Path, record: dict[str, Any]) -> dict[str, Any]:
    """The first failure of an attempt that ended without closing its record, from its evidence."""
    attempt_id = record["id"]
    reports = []
    for path in sorted((attempts_dir(run_dir) / "failures").glob(f"{attempt_id}.rank-*.json")):
        try:
            reports.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError):
            continue
    # Injected kills and hangs leave no report of their own; an injected exception does.
    injected = [e for e in _injected_faults(run_dir, attempt_id) if e.get("signal") != "exception"]
    if injected:
        first = injected[0]
        sig = first.get("signal")
        return {
            "rank": first["rank"],
            "exit_code": -9 if sig == "SIGKILL" else None,
            "exception": None,
            "classification": Classification.INFRASTRUCTURE.value,
            "evidence": f"injected {sig} at step {first.get('step')}"
            + (f" ({first['during']})" if first.get("during") else ""),
            "reports": len(reports),
        }
    # Evidence in order of weight: a rank that failed on its own; ranks that sent no report at
    # all (killed or lost: a group restart's SIGTERM or a vanished peer makes the others report);
    # a preemption that reached the ranks; the first report of a lost peer or monitor.
    own = [r for r in reports if not r.get("peer_lost") and r["classification"] != Classification.PREEMPTED.value]
    if own:
        return _reported(min(own, key=lambda r: r["time"]), reports)
    silent = sorted(set(range(int(record.get("world_size", 0)))) - {r["rank"] for r in reports})
    if silent:
        return _silent(run_dir, record, silent, reports)
    preempted = [r for r in reports if r["classification"] == Classification.PREEMPTED.value]
    return _reported(min(preempted or reports, key=lambda r: r["time"]), reports)


def _reported(first: dict[str, Any], reports: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "rank": first["rank"],
        "ranks": [first["rank"]],
        "exit_code": first.get("exit_code"),
        "exception": first.get("exception"),
        "classification": first["classification"],
        "evidence": f"rank {first['rank']} on {first.get('host')} reported it"
        + (" (a lost peer or rank monitor)" if first.get("peer_lost") else ""),
        "reports": len(reports),
    }


def _silent(run_dir: Path, record: dict[str, Any], silent: list[int], reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Ranks that ended without a report; the phase each was last in, from its phase record when
    that record belongs to this attempt (its process started after the attempt did). A rank that a
    fatal signal ended, or whose pulse stopped long before its peers' (a hang), is named as such."""
    phases = read_phases(run_dir)
    started = record.get("process_started_at") or record.get("started_at") or 0
    attempt = record.get("id")
    every = {r: rec for r, p in phases.items() if (rec := record_of(p, started, attempt=attempt))}
    recs = {r: every[r] for r in silent if r in every}
    where = {r: recs[r]["phase"] for r in silent if r in recs}
    fatal = {r: f for r in silent if (f := fatal_signal(ranks_dir(run_dir), r, recs.get(r, {}).get("pid")))}
    if fatal:
        return _fatal_failure(fatal, where, reports)
    if (lost := _lost_node(run_dir, attempt, silent, where, reports)) is not None:
        return lost
    watched = _watch_kills(run_dir, {r: rec["pid"] for r, rec in recs.items() if "pid" in rec})
    if watched:  # the node's hang watch saw these ranks stop while their peers pulsed, and killed them
        return _silent_failure(sorted(watched), where, record, reports, hung_for=max(watched.values()))
    alive = {r: float(rec["last_alive"]) for r, rec in every.items() if "last_alive" in rec}
    phase = {r: rec.get("phase") for r, rec in every.items()}
    hung = _hung(alive, silent, reports, phase, record.get("hang_timeout_s"))
    if hung is not None:
        return _silent_failure(hung[0], where, record, reports, hung_for=hung[1])
    # A rank whose record says it was told to stop (SIGTERM from the launcher stopping the group)
    # did not fail first; the ranks that died without being told did.
    unsignalled = [r for r in silent if "signal" not in recs.get(r, {})]
    silent = unsignalled or silent
    return _silent_failure(silent, {r: where[r] for r in silent if r in where}, record, reports)


def _hung(
    alive: dict[int, float],
    silent: list[int],
    reports: list[dict[str, Any]],
    phase: dict[int, str | None],
    hang_timeout_s: float | None = None,
) -> tuple[list[int], float] | None:
    """The silent ranks whose pulse stopped ``HUNG_GAP_S`` (in training: ``HUNG_GAP_TRAINING_S``,
    or half the attempt's hang timeout if longer) or more before every other rank's, and the gap;
    None when nothing stands out that far, or when a peer reported losing them that soon (a kill:
    peers see the connection close at their next collective).

    Why half the hang timeout: a hung rank's peers pulse on until the monitors kill the group, the
    timeout after the step began, so they outlive it by the timeout less at most one step; a killed
    rank's peers notice at their next collective, at most a step later. Halfway splits the two
    while a step is shorter than half the timeout; a fixed 1.5 s read a kill as a hang at load 19
    on 2 cores, where a step took 3.3 s and the survivor reported the reset 2.7 s after the kill."""
    if len(alive) < 2:
        return None
    first = min(alive.values())
    early = sorted(r for r, t in alive.items() if t <= first + 2 * PULSE_S)
    later = [t for r, t in alive.items() if r not in early]
    if not later or not set(early) <= set(silent):
        return None
    stopped = max(alive[r] for r in early)
    gap = min(later) - stopped
    training = max(HUNG_GAP_TRAINING_S, (hang_timeout_s or 0.0) / 2)
    least = training if all(phase.get(r) == "training" for r in early) else HUNG_GAP_S
    # A peer that saw the connection drop before the monitor could have killed a hung rank (the
    # hang timeout less a step) saw a kill: a hung rank's peers are stopped by their own monitors
    # at that timeout, without a report. At load 20 on 2 cores a survivor saw a kill 4.6 s late.
    noticed = max(least, 0.8 * hang_timeout_s) if hang_timeout_s and least == training else least
    lost = any(rep.get("peer_lost") and rep.get("time", 0) < stopped + noticed for rep in reports)
    return (early, gap) if gap >= least and not lost else None


def _fatal_failure(
    fatal: dict[int, tuple[int, str]], where: dict[int, str], reports: list[dict[str, Any]]
) -> dict[str, Any]:
    rank = min(fatal)
    number, frame = fatal[rank]
    during = f" during {where[rank]}" if rank in where else ""
    return {
        "rank": rank,
        "ranks": sorted(fatal),
        "exit_code": -number,
        "exception": None,
        "classification": Classification.INFRASTRUCTURE.value,
        "evidence": f"rank {rank} was killed by signal {number} ({signal.Signals(number).name}){during}"
        + (f" at {frame}" if frame else ""),
        "phases": {str(r): p for r, p in where.items()},
        "reports": len(reports),
    }


def _silent_failure(
    silent: list[int],
    where: dict[int, str],
    record: dict[str, Any],
    reports: list[dict[str, Any]],
    hung_for: float | None = None,
) -> dict[str, Any]:
    last = sorted({where[r] for r in silent if r in where})
    everyone = len(silent) == int(record.get("world_size", 0))
    if hung_for is not None:
        evidence = (
            f"ranks {silent} hung: no sign of life for {hung_for:.1f}s before the other ranks stopped "
            "(stopped, or deadlocked holding the GIL; never exited by themselves)"
        )
    elif everyone:
        evidence = "every rank ended without a report (the whole group was killed or lost)"
    else:
        evidence = f"ranks {silent} ended without a report (killed, hung or lost)"
    return {
        "rank": silent[0],
        "ranks": silent,
        "exit_code": None,
        "exception": None,
        "classification": Classification.INFRASTRUCTURE.value,
        "evidence": evidence + (f" during {'/'.join(last)}" if last else ""),
        "phases": {str(r): p for r, p in where.items()},
        "reports": len(reports),
    }


def needs_diagnosis(record: dict[str, Any]) -> bool:
    """Died open, closed by a rank 0 that only saw a peer vanish, or preempted without its
    emergency step (a rank may have been lost during the save)."""
    status, failure = record.get("status"), record.get("failure")
    if status == "preempted":
        return not failure and record.get("emergency_published") is False
    return status == "running" or (status == "failed" and not failure)


def _claim_number(d: Path, number: int) -> tuple[int, Path]:
    """The next free ``attempt-NN.json`` from ``number`` on, created empty with O_EXCL."""
    while True:
        path = d / f"attempt-{number:02d}.json"
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            return number, path
        except FileExistsError:
            number += 1


class AttemptLog:
    """Rank 0's record of the current attempt; other ranks hold a disabled instance."""

    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.run_dir = run_dir
        self.enabled = enabled
        self.path: Path | None = None
        self.record: dict[str, Any] = {}
        self.previous: dict[str, Any] | None = None
        self.history: list[dict[str, Any]] = []  # earlier attempts, closed

    def begin(self, attempt_id: str, world_size: int, hosts: list[str], restarts: dict[str, Any]) -> None:
        """Close the previous record if it died open, then create the next ``attempt-NN.json``."""
        if not self.enabled:
            return
        d = attempts_dir(self.run_dir)
        d.mkdir(parents=True, exist_ok=True)
        existing = read_attempts(self.run_dir)
        self.previous = existing[-1] if existing else None
        if self.previous is not None and needs_diagnosis(self.previous):
            self._close_dead(self.previous)
        existing += self._record_unrecorded(d, existing, world_size, restarts)
        self.history = existing
        number, path = _claim_number(d, len(existing) + 1)
        self.path = path
        self.record = {
            "attempt": number,
            "id": attempt_id,
            "status": "running",
            "started_at": time.time(),
            "process_started_at": _process_start(),
            "ended_at": None,
            "world_size": world_size,
            "hosts": sorted(set(hosts)),
            "ranks_by_host": {h: [r for r, x in enumerate(hosts) if x == h] for h in sorted(set(hosts))},
            **restarts,
            "restored": None,
            "lost_steps": None,
            "first_step": None,
            "last_step": None,
            "time_to_first_step_seconds": None,
            "rto_seconds": None,
            "failure": None,
            "scaled": scaled_from(existing, hosts, world_size),
        }
        if self.record["scaled"] is not None:
            sc = self.record["scaled"]
            log.warning(
                "this attempt runs on %d node(s) (%d ranks); the previous one ran on %d (%d ranks): the run scaled",
                sc["to_nodes"],
                sc["to_world_size"],
                sc["from_nodes"],
                sc["from_world_size"],
            )
        self._flush()

    def _record_unrecorded(
        self, d: Path, existing: list[dict[str, Any]], world_size: int, restarts: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """Attempts of this launcher that died before rank 0 wrote their record (killed during
        start-up or rendezvous): one record each, from the phase records their ranks left."""
        prev = existing[-1] if existing else None
        mine = int(restarts.get("launcher_restart_count", 0))
        if prev is not None and prev.get("launcher_run_id") != restarts.get("launcher_run_id"):
            return []
        first = int(prev.get("launcher_restart_count", 0)) + 1 if prev is not None else 0
        since = float(prev.get("started_at", 0)) if prev is not None else 0.0
        phases = read_phases(self.run_dir)
        out = []
        for restart in range(first, mine):
            recs = {r: rec for r in range(world_size) if (rec := record_of(phases.get(r), since, restart=restart))}
            dead = [r for r in sorted(recs) if "signal" not in recs[r]] or sorted(recs)
            number, path = _claim_number(d, len(existing) + len(out) + 1)
            record = {
                "attempt": number,
                "id": f"restart-{restart}-unrecorded",
                "status": "failed",
                "world_size": world_size,
                "launcher_restart_count": restart,
                "launcher_run_id": restarts.get("launcher_run_id"),
                "started_at": min((rec["time"] for rec in recs.values()), default=since),
                "ended_at": max((rec["time"] for rec in recs.values()), default=since),
                "restored": None,
                "last_step": None,
                "closed_by_next_attempt": True,
                "failure": _silent_failure(dead, {r: recs[r]["phase"] for r in dead}, {"world_size": world_size}, [])
                if dead
                else {
                    "rank": None,
                    "ranks": [],
                    "classification": Classification.INFRASTRUCTURE.value,
                    "evidence": "the attempt died before any rank left a record",
                    "exception": None,
                },
            }
            write_json_atomic(path, record)
            out.append(record)
        return out

    def _close_dead(self, prev: dict[str, Any]) -> None:
        last_step, last_time = _last_progress(self.run_dir, prev["id"])
        failure = diagnose(self.run_dir, prev)
        if prev.get("status") == "preempted":
            if failure.get("classification") == Classification.PREEMPTED.value:
                return  # every rank reported the preemption: nothing was lost
        else:
            prev["status"] = "failed"
        prev["failure"] = failure
        if last_step is not None:
            prev["last_step"] = last_step
        # the last sign of life: its last finished step (or its own end, if it recorded one)
        prev["ended_at"] = max(t for t in (last_time, prev.get("ended_at"), prev.get("started_at")) if t)
        prev["closed_by_next_attempt"] = True
        write_json_atomic(attempts_dir(self.run_dir) / f"attempt-{prev['attempt']:02d}.json", prev)

    def restored(self, tier: str | None, step: int | None, seconds: float | None) -> None:
        if not self.enabled:
            return
        self.record["restored"] = None if step is None else {"tier": tier, "step": step, "seconds": seconds}
        # The furthest step any earlier attempt finished (the one before may have died restoring).
        prev_last = max((r["last_step"] for r in self.history if isinstance(r.get("last_step"), int)), default=None)
        if prev_last is not None:
            self.record["lost_steps"] = max(0, prev_last - (step or 0))
        self._flush()

    def first_step(self, step: int) -> None:
        if not self.enabled:
            return
        now = time.time()
        self.record["first_step"] = step
        # from the rank program's start (imports, process group, restore included) to a finished step
        self.record["time_to_first_step_seconds"] = round(now - self.record["process_started_at"], 3)
        prev = self.previous or {}
        if prev.get("ended_at"):
            # recovery time objective: from the previous attempt's last sign of life to our first step
            self.record["rto_seconds"] = round(now - prev["ended_at"], 3)
        self._flush()

    def note(self, **fields: Any) -> None:
        """Facts of this attempt that are not a step: e.g. ``hang_timeout_s``, the seconds in which
        its rank monitor kills a rank stuck in a step (what tells a hang from a late-seen kill)."""
        if not self.enabled:
            return
        self.record.update(fields)
        self._flush()

    def progress(self, step: int, **fields: Any) -> None:
        if not self.enabled:
            return
        self.record["last_step"] = step
        self.record.update(fields)
        self._flush()

    def end(self, status: str, step: int | None, failure: FailureInfo | None = None, **fields: Any) -> None:
        if not self.enabled or self.path is None:
            return
        self.record.update(status=status, ended_at=time.time(), **fields)
        if step is not None:
            self.record["last_step"] = step
        if failure is not None:
            self.record["failure"] = {"rank": 0, **failure.to_dict()}
        self._flush()

    def _flush(self) -> None:
        if self.path is not None:
            write_json_atomic(self.path, self.record)

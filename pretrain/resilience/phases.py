"""Where each rank is in its attempt: one small record per rank, replaced at every phase change.

``<run.dir>/<run.id>/ranks/rank-NNNNN.json`` holds ``{phase, restart, pid, host, time}`` and is
replaced atomically each time the rank enters a phase of start-up or recovery. Operators read it
(``pretrain status``) to see where a stuck or failing recovery is; the next attempt's diagnosis
names the phase a silent rank died in; drills and tests read it to inject a fault from outside the
job at a chosen phase. Writes are a few per attempt (never per step) and never raise: a record
that cannot be written must not fail the rank.

Two signs of life outlive the rank for its diagnosis. A pulse thread touches a node-local file
(:func:`pulse_path`, under ``/dev/shm``, holding the process's pid) every ``PULSE_S`` (its mtime,
no write): a rank stopped (SIGSTOP) or deadlocked with the GIL held stops pulsing while its peers,
blocked in a collective with the GIL released, go on until the launcher stops them, so the rank
that hung is the one whose pulse stopped first by far (``last_alive``). The pulse never touches
the shared run directory (5 setattr RPCs a second per rank on Lustre or NFS at 2,000 ranks is a
metadata load, and a stalled mount would put the thread in D): the rank's next process on the node
reads it when it replaces the record and carries ``last_alive`` along in ``previous``; a reader on
the same host (:func:`read_phases`) reads it too; elsewhere the record's own mtime stands in.
A fatal signal (SIGSEGV, SIGBUS, SIGFPE, SIGABRT, SIGILL) writes ``fatal-rank-NNNNN-pid-P.txt``
through :mod:`faulthandler` (the signal and the Python stack), named by the process, so that the
next attempt can say which signal ended which rank.

``on_enter`` runs after each record is written: the fault injection's hold
(``pretrain.resilience.faults.phase_hold``) keeps a rank in a phase so that an outside fault can
land inside a phase that is otherwise milliseconds long.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from pretrain.resilience.restarts import launcher_restart_count
from tiering.errors import UnsafeDirectory
from tiering.system.fsio import atomic_write_bytes
from tiering.system.private_dir import private_dir

log = logging.getLogger(__name__)

PULSE_S = 0.2  # how often a live rank touches its pulse file (an mtime: the hang gap is read to this)
# Node-local (tmpfs), never the shared run dir; one 0700 root per user: the node's agent kills a
# rank whose pulse stops (pretrain.resilience.hang_watch), so nobody else may write a pulse there.
PULSE_ROOT = Path(f"/dev/shm/resilient-pretrain-pulse-{os.getuid()}")
FATAL_SIGNALS = {"Segmentation fault": 11, "Bus error": 7, "Floating point exception": 8, "Aborted": 6}

# In the order an attempt goes through them.
PHASES = (
    "startup",  # the rank program started (imports done), no process group yet
    "rendezvous",  # creating the process group
    "monitor",  # connected to the NVRx rank monitor
    "verify",  # verifying tier 1-2 copies of the step to restore
    "transfer",  # sending or receiving a replica for a restore
    "load",  # loading verified bytes into the model and optimizer
    "first_steps",  # restored, before the first step (the poison window starts)
    "training",  # the first step after start-up finished
    "emergency_save",  # a preemption signal arrived: publishing the emergency tier-1 step
)


def ranks_dir(run_dir: Path) -> Path:
    return run_dir / "ranks"


def pulse_path(run_dir: Path, rank: int, root: Path = PULSE_ROOT) -> Path:
    """This node's pulse file of ``rank`` in the run at ``run_dir`` (one folder per run directory)."""
    key = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return root / key / f"rank-{rank:05d}.pulse"


def last_pulse(pulse: Path, record: dict[str, Any]) -> float | None:
    """When the process of ``record`` last pulsed, if its pulse file is on this host; else None."""
    if record.get("host") != socket.gethostname():
        return None
    try:
        if int(pulse.read_text() or -1) != record.get("pid"):
            return None  # another process's (an older attempt's, or the pulse never started)
        return pulse.stat().st_mtime
    except (OSError, ValueError):
        return None


def parse_holds(spec: str | None) -> set[tuple[int, str]]:
    """``"1:verify,2:load"`` -> {(1, "verify"), (2, "load")}; raises ValueError naming a bad item."""
    out: set[tuple[int, str]] = set()
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        restart, _, phase = item.partition(":")
        if not restart.strip().isdigit() or phase.strip() not in PHASES:
            raise ValueError(f"{item!r} is not RESTART:PHASE with PHASE one of {', '.join(PHASES)}")
        out.add((int(restart), phase.strip()))
    return out


class PhaseRecord:
    """This rank's phase record (see the module docstring)."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        on_enter: Callable[[str], None] = lambda phase: None,
        pulse_root: Path = PULSE_ROOT,
    ) -> None:
        self.path = ranks_dir(run_dir) / f"rank-{rank:05d}.json"
        self.pulse = pulse_path(run_dir, rank, pulse_root)
        self.rank = rank
        self.restart = launcher_restart_count()
        self.on_enter = on_enter
        self.phase: str | None = None
        self.attempt: str | None = None  # set once the group agreed on the attempt id
        self.previous: dict[str, Any] | None = None  # the last record of the process before this one
        self._read_previous = False
        self._record: dict[str, Any] = {}
        self._kept: dict[str, Any] = {}  # details every record of this process carries (see keep)
        self._fatal: IO[str] | None = None

    def enter(self, phase: str, **details: Any) -> None:
        assert phase in PHASES, phase
        if phase == self.phase:
            return
        self.phase = phase
        self._carry_previous()
        self._record = {
            "rank": self.rank,
            "phase": phase,
            "restart": self.restart,
            "attempt": self.attempt,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "time": time.time(),
            **self._kept,
            **details,
            "previous": self.previous,
        }
        self._write()
        self.on_enter(phase)

    def keep(self, **details: Any) -> None:
        """Details this record carries from now on, in every phase (e.g. ``hang_watch_s``, the
        limit the node's hang watch holds this rank to); written at once."""
        self._kept.update(details)
        if self._record:
            self._record.update(details)
            self._write()

    def _carry_previous(self) -> None:
        """Once, before this process replaces the record or the pulse file: the next attempt's
        diagnosis needs the phase a killed rank died in and its last pulse: carry them along, one
        level deep."""
        if self._read_previous:
            return
        self._read_previous = True
        try:
            written = self.path.stat().st_mtime  # when it was last replaced: this record replaces it
            old = json.loads(self.path.read_text(encoding="utf-8"))
            alive = last_pulse(self.pulse, old) or written
            self.previous = {k: v for k, v in old.items() if k != "previous"} | {"last_alive": alive}
        except (OSError, ValueError):
            self.previous = None

    def _write(self) -> None:
        if self._record and self._record.get("pid") != os.getpid():
            # A forked copy of the rank (a background writer) that got the group's SIGTERM after
            # the rank died: its copy of the record is stale and the record is not its own.
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self.path, json.dumps(self._record).encode())
        except OSError as exc:  # a diagnosis aid only: training goes on without it
            log.warning("%s: phase record not written (%s)", self.path, exc)

    def start_pulse(self) -> None:
        """Touch the record every ``PULSE_S`` from a daemon thread, and report a fatal signal into
        this process's own file (see the module docstring)."""
        fatal = fatal_report_path(self.path.parent, self.rank, os.getpid())
        with contextlib.suppress(OSError):
            for stale in self.path.parent.glob(f"fatal-rank-{self.rank:05d}-pid-*.txt"):
                if stale.stat().st_size == 0:
                    stale.unlink()  # earlier processes of this rank that ended without a fatal signal
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fatal = open(fatal, "w")  # noqa: SIM115 - kept open for the life of the process
            faulthandler.enable(file=self._fatal, all_threads=False)
        self._carry_previous()  # the previous process's pulse, before this one's replaces it
        try:
            private_dir(self.pulse.parent.parent)
            private_dir(self.pulse.parent)
            atomic_write_bytes(self.pulse, str(os.getpid()).encode())
        except (OSError, UnsafeDirectory) as exc:  # a diagnosis aid only
            log.warning("%s: no pulse (%s); a hang is then told from the phase records alone", self.pulse, exc)
            return
        threading.Thread(target=self._pulse, name="phase-pulse", daemon=True).start()

    def _pulse(self) -> None:
        due = time.monotonic() + PULSE_S
        while True:
            time.sleep(PULSE_S)
            now = time.monotonic()
            overslept = now - due > PULSE_S
            due = now + PULSE_S
            if overslept:
                # This process was stopped (SIGSTOP) or starved: no pulse on waking. NVRx's rank
                # monitor sends SIGCONT right before its SIGKILL, and a pulse squeezed in between
                # made a hung rank look alive until its kill (seen: "every rank ended without a report").
                continue
            with contextlib.suppress(OSError):  # removed by a cleanup: the record's mtime stands in
                os.utime(self.pulse)

    def mark_signal(self, name: str) -> None:
        """This rank was told to stop (the launcher stopping the group after another rank failed, or
        a preemption): the diagnosis then knows it is not the rank that failed first."""
        if self._record:
            self._record["signal"] = name
            self._write()

    def mark_signals_until_replaced(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)) -> None:
        """Before the preemption handlers exist (start-up): mark the record, then die of the signal as
        before. Main thread only (Python delivers signals there)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: Any) -> None:
            self.mark_signal(signal.Signals(signum).name)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        for sig in signals:
            signal.signal(sig, handler)


def record_of(
    record: dict[str, Any] | None, since: float, attempt: str | None = None, restart: int | None = None
) -> dict[str, Any] | None:
    """A rank's last record in an attempt: its current record or the one its next process carried
    along. A recorded attempt is matched by its id (every rank learnt it before the record was
    written); an attempt that died before it had one, by the launcher restart count and time
    (restart counts are per launcher: on several nodes only the id identifies an attempt)."""
    for rec in (record, (record or {}).get("previous")):
        if not rec or rec.get("time", 0) < since - 5:
            continue
        if attempt is not None and rec.get("attempt") == attempt:
            return rec
        if attempt is None and rec.get("attempt") is None and rec.get("restart") == restart:
            return rec
    return None


def ranks_in_phase(
    run_dir: Path, restart: int | None, phase: str, ranks: list[int], exclude_pids: frozenset[int] = frozenset()
) -> dict[int, int] | None:
    """{rank: pid} if every rank of ``ranks`` is now in ``phase`` of launcher restart ``restart``
    (any restart if None; processes in ``exclude_pids`` do not count)."""
    phases = read_phases(run_dir)
    pids = {}
    for rank in ranks:
        rec = phases.get(rank)
        if rec is None or rec.get("phase") != phase or int(rec["pid"]) in exclude_pids:
            return None
        if restart is not None and rec.get("restart") != restart:
            return None
        pids[rank] = int(rec["pid"])
    return pids


def read_phases(run_dir: Path, pulse_root: Path = PULSE_ROOT) -> dict[int, dict[str, Any]]:
    """Every rank's last phase record, by rank (unreadable files are skipped: they are being replaced),
    with ``last_alive``: its pulse where this host holds it, else when the record was written."""
    out: dict[int, dict[str, Any]] = {}
    base = ranks_dir(run_dir)
    if not base.is_dir():
        return out
    for path in sorted(base.glob("rank-*.json")):
        try:
            written = path.stat().st_mtime  # the record's last replacement
            rec = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        alive = last_pulse(pulse_path(run_dir, int(rec["rank"]), pulse_root), rec) or written
        out[int(rec["rank"])] = rec | {"last_alive": alive}
    return out


def fatal_report_path(ranks: Path, rank: int, pid: int) -> Path:
    return ranks / f"fatal-rank-{rank:05d}-pid-{pid}.txt"


def fatal_signal(ranks: Path, rank: int, pid: int | None) -> tuple[int, str] | None:
    """(signal number, first frame) if the process ``pid`` of ``rank`` died of a fatal signal that
    :mod:`faulthandler` reported; None otherwise."""
    if pid is None:
        return None
    try:
        text = fatal_report_path(ranks, rank, pid).read_text(errors="replace")
    except OSError:
        return None
    for name, number in FATAL_SIGNALS.items():
        if f"Fatal Python error: {name}" in text:
            frames = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("File ")]
            return number, frames[0] if frames else ""
    return None

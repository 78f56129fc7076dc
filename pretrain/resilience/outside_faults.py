"""Faults injected from outside a running job, at moments read from the job's own records
(``pretrain drill`` and the recovery-fault tests).

A :class:`PhaseKiller` thread follows the run's phase records (``<run>/ranks/rank-N.json``, see
``pretrain.resilience.phases``) and ``metrics.jsonl``; when the ranks it targets are in the planned phase of
the planned launcher restart, it signals their processes by PID. Nothing sleeps to guess a moment:
each action waits for the records that prove the job is where the fault belongs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.resilience.phases import ranks_in_phase, read_phases


@dataclass
class Fault:
    # The launcher restart count of the attempt to hit; None: the next attempt after the previous
    # fault (its ranks are processes that did not exist then): counts differ between launchers.
    restart: int | None
    phase: str  # the phase the target ranks must be in (pretrain.resilience.phases.PHASES)
    ranks: list[int]  # the ranks to signal
    sig: int = signal.SIGKILL
    after_step: int | None = None  # also wait until metrics.jsonl has reached this step
    then: Any = None  # called (no arguments) right after the signal, e.g. to wipe a node's disk
    done: dict[str, Any] = field(default_factory=dict)  # what happened: time, pids


class PhaseKiller(threading.Thread):
    def __init__(self, run_dir: Path, faults: list[Fault], timeout: float = 400.0) -> None:
        super().__init__(daemon=True)
        self.run_dir = run_dir
        self.faults = faults
        self.deadline = time.monotonic() + timeout
        self.error: str | None = None
        self._halt = threading.Event()
        self.old_pids: set[int] = set()  # processes that existed at the previous fault

    def stop(self) -> None:
        self._halt.set()

    def _max_step(self) -> int:
        try:
            lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        except OSError:
            return 0
        steps = [json.loads(x)["step"] for x in lines[-50:] if x.strip()]
        return max(steps, default=0)

    def _ready(self, fault: Fault) -> dict[int, int] | None:
        """{rank: pid} once every target rank is in the fault's phase of its restart."""
        old = frozenset(self.old_pids) if fault.restart is None else frozenset()
        pids = ranks_in_phase(self.run_dir, fault.restart, fault.phase, fault.ranks, old)
        if pids is None:
            return None
        if fault.after_step is not None and self._max_step() < fault.after_step:
            return None
        return pids

    def run(self) -> None:
        for fault in self.faults:
            while (pids := self._ready(fault)) is None:
                if self._halt.is_set():
                    return
                if time.monotonic() > self.deadline:
                    self.error = f"never saw ranks {fault.ranks} in phase {fault.phase} of restart {fault.restart}"
                    return
                time.sleep(0.02)
            for pid in pids.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, fault.sig)
            fault.done = {"time": time.time(), "pids": pids}
            self.old_pids |= {int(rec["pid"]) for rec in read_phases(self.run_dir).values()}
            if fault.then is not None:
                fault.then()

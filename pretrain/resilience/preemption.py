"""Preemption: SIGTERM (Kubernetes termination, ``ft_launcher``/``torchrun`` shutdown) or SIGUSR1
(Slurm ``--signal``) asks the rank program to save and leave.

The handler only notes the request; the training loop agrees on it collectively at the next
step boundary (one extra element in the step's loss all-reduce), saves tier 1 with a deadline
and exits with :class:`~pretrain.resilience.failures.PreemptedError`. A watchdog thread enforces the deadline
for the case where the main thread never reaches a step boundary (a hung or dead peer): it exits
the process, and since publishing is atomic, nothing partial is ever visible.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pretrain.errors import PreemptedError

log = logging.getLogger(__name__)


def parse_signals(names: str) -> list[signal.Signals]:
    """``"SIGTERM,SIGUSR1"`` -> signals; raises ValueError naming an unknown one."""
    out = []
    for name in (n.strip() for n in names.split(",")):
        if not name:
            continue
        try:
            out.append(signal.Signals[name if name.startswith("SIG") else f"SIG{name}"])
        except KeyError as exc:
            raise ValueError(f"unknown signal {name!r}") from exc
    return out


class PreemptionWatch:
    """Installs the handlers; ``requested`` turns true at the first signal and stays true."""

    def __init__(
        self,
        signals: list[signal.Signals],
        timeout_s: float,
        on_deadline: Callable[[str], None],
        on_signal: Callable[[str], None] = lambda name: None,
    ) -> None:
        self.timeout_s = timeout_s
        self._on_signal = on_signal  # e.g. mark this rank's phase record
        self.signal_name: str | None = None
        self.deadline: float | None = None  # time.monotonic() by which the emergency save must be published
        self._on_deadline = on_deadline
        self._done = threading.Event()
        # Held while a thread records how the attempt ended: the watchdog's record, written just
        # before the process exits, must never be overwritten by the main thread's (a peer that
        # left at its own deadline made a CI run record the preemption as a failure).
        self._ending = threading.Lock()
        self._previous: dict[signal.Signals, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal_name is not None:
            return
        self.signal_name = signal.Signals(signum).name
        self.deadline = time.monotonic() + self.timeout_s
        self._on_signal(self.signal_name)
        threading.Thread(target=self._watchdog, name="preemption-deadline", daemon=True).start()

    def _watchdog(self) -> None:
        if self._done.wait(self.timeout_s):
            return
        message = (
            f"{self.signal_name}: the emergency save did not finish within "
            f"fault_tolerance.emergency_save_timeout={self.timeout_s}s; exiting without publishing it"
        )
        self._ending.acquire()  # never released: the process exits holding it
        try:
            self._on_deadline(message)
        finally:
            os._exit(PreemptedError.EXIT_CODE)

    @contextmanager
    def ending(self) -> Iterator[None]:
        """Record the attempt's end inside this: past the deadline, the watchdog's record stands
        (a thread waiting here then exits with the process)."""
        with self._ending:
            yield

    def finished(self) -> None:
        """The emergency path is over (saved or given up): disarm the watchdog."""
        self._done.set()

    def uninstall(self) -> None:
        self._done.set()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

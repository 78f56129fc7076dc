"""NVRx fault-tolerance hooks for the rank program: heartbeats and deliberate fault injection."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
from nvidia_resiliency_ext.fault_tolerance.data import FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR

from pretrain.config import FaultToleranceConfig

log = logging.getLogger(__name__)


class RankMonitor:
    """This rank's link to its NVRx rank monitor under ``ft_launcher`` (a no-op otherwise).

    Heartbeats after every step, and sections: ``setup`` (start-up and restore), ``step`` (one
    training step) and ``checkpointing`` (saves), so that a slow save is judged by the
    checkpointing timeout, never by the step timeout. After ``fault_tolerance.calculate_timeouts_after``
    steps the timeouts are measured (NVRx synchronises them across ranks) and from then on travel
    in the checkpoint, so a restarted group starts with measured timeouts.
    """

    def __init__(self, ft: FaultToleranceConfig) -> None:
        self.client = None
        self.calculate_after = ft.calculate_timeouts_after
        self.calculated = False
        self._open: set[str] = set()
        self.wedged = False  # the launcher's rank monitor refused this rank (see _first_message)
        # Set by the trainer: true once a preemption signal arrived. Slurm and Kubernetes signal
        # every process, so NVRx's rank monitor may die before this rank reaches its emergency save.
        self.leaving: Callable[[], bool] = lambda: False
        if ft.enabled and os.environ.get(FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR):
            self.client = RankMonitorClient()
            self.client.init_workload_monitoring()
            self._first_message()
            if self.client is not None:
                log.info("ft_launcher rank monitor connected: heartbeats and sections on")

    def _first_message(self) -> None:
        """Tell the rank monitor at once that this rank is alive: a heartbeat-free message.

        NVRx 0.4.1's rank monitor outlives the worker group (launcher.py ``setup_rank_monitors``
        starts one per local rank once) and its state machine (rank_monitor_state_machine.py) moves
        to HANDLING_START when a rank's connection is lost, back to HANDLING_COMPLETED only on the
        next heartbeat or section message (``_handle_msg``), and to the terminal ABORTED state when a
        connection is lost again before such a message (``handle_ipc_connection_lost``). A rank
        killed during start-up or restore, i.e. before its first heartbeat, therefore wedged its
        monitor: every later rank on it failed its first heartbeat with "Unexpected reply: None".
        A CLOSE_ALL section message is valid with or without configured sections, changes no
        timeout (``_handle_section_msg``) and completes the monitor's restart handling, shrinking
        the window from the whole restore to the microseconds between two messages.

        If the monitor is already wedged (an earlier rank died inside that window), this rank goes
        on without it: peers' monitors still see a hang (it blocks their collectives), and a
        monitor that can never accept a message again must not turn every restart into a failure.
        """
        try:
            self.client.end_all_sections()
        except Exception as exc:  # noqa: BLE001 - RankMonitorClientError, whatever NVRx wraps
            log.error(
                "rank monitor of local rank %s is unusable (NVRx 0.4.1 ABORTED state after a rank died "
                "before its first message: %s); this rank continues without heartbeats, its peers' "
                "monitors still detect a hang; fix: restart the launcher of this node when convenient",
                os.environ.get("LOCAL_RANK", "?"),
                exc,
            )
            self.wedged = True
            self.client = None

    @property
    def active(self) -> bool:
        return self.client is not None

    def _call(self, fn: Callable[[], Any]) -> None:
        if self.client is None:
            return
        try:
            fn()
        except Exception:
            # The monitor is gone. During a shutdown that is expected: stop talking to it and let
            # the emergency save run. Otherwise it is an infrastructure failure of this rank.
            for _ in range(20):  # the signal may trail the monitor's death by a few milliseconds
                if self.leaving():
                    log.warning("rank monitor gone during shutdown: heartbeats off")
                    self.client = None
                    return
                time.sleep(0.05)
            raise

    def beat(self) -> None:
        self._call(lambda: self.client.send_heartbeat())

    def _declared(self, section: str) -> bool:
        """NVRx refuses sections its FT config does not name: use only the declared ones."""
        return self.client is not None and section in (self.client.cfg.rank_section_timeouts or {})

    def start(self, section: str) -> None:
        if self._declared(section) and section not in self._open:
            self._call(lambda: self.client.start_section(section))
            self._open.add(section)

    def end(self, section: str) -> None:
        if self._declared(section) and section in self._open:
            self._call(lambda: self.client.end_section(section))
            self._open.discard(section)

    def maybe_calculate_timeouts(self, steps_done: int) -> dict[str, Any] | None:
        """Collective (all ranks at the same step): measure and set the section timeouts once.

        Only the ``step`` section is measured, and only when the launcher's FT config uses
        sections. ``setup``, ``checkpointing`` and out-of-section timeouts stay as configured: one
        start-up and a few saves are too few samples, save times vary with the tier and the
        storage, and the gaps between sections are milliseconds, so a measured out-of-section
        timeout would turn a garbage-collection pause into a "hang". Heartbeat timeouts are never
        measured: a heartbeat cannot tell a save from a hang, so a timeout measured over fast steps
        kills the first slow save (the known false positive); use sections for tight detection.
        """
        if self.client is None or self.calculated or not self.calculate_after or steps_done < self.calculate_after:
            return None
        self.calculated = True
        if not self.client.cfg.rank_section_timeouts:
            return None
        self.client.calculate_and_set_section_timeouts(
            selected_sections=["step"], calc_out_of_section=False, skip_if_not_ready=True
        )
        state = self.state_dict()
        log.info("fault-tolerance timeouts measured after %d steps: %s", steps_done, state)
        return state

    def hang_timeout_s(self) -> float | None:
        """The seconds after which a rank stuck in a training step is killed now: the ``step``
        section's timeout in force (configured, measured or loaded) or the heartbeat timeout,
        whichever is shorter; None without a monitor or without either. The attempt records use it
        to tell a hang (its peers outlive it by about this long) from a kill noticed late."""
        if self.client is None:
            return None
        found: list[float] = []
        sections = self.client.section_timeouts
        step = (sections.section if sections is not None else self.client.cfg.rank_section_timeouts or {}).get("step")
        if step is not None:
            found.append(float(step))
        heartbeat = self.client.hb_timeouts
        beat = heartbeat.subsequent if heartbeat is not None else self.client.cfg.rank_heartbeat_timeout
        if beat is not None:
            found.append(float(beat))
        return min(found, default=None)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.client.state_dict()) if self.client is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        if self.client is None or not state:
            return False
        self.client.load_state_dict(state)
        self.calculated = True
        return True

    def close(self) -> None:
        if self.client is not None:
            try:
                if self.client.cfg.rank_section_timeouts:  # an undeclared section message kills the rank
                    self.client.end_all_sections()
                self.client.shutdown_workload_monitoring()
            except Exception:  # noqa: BLE001 - the monitor may already be gone at exit
                pass
            self.client = None

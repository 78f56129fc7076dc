"""Schema of ``fault_tolerance``: heartbeats and sections, preemption, stops, in-process restart,
and the deliberate faults (``inject``) drills and tests use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pretrain.config.fail import Fail, positive
from pretrain.resilience.phases import parse_holds
from pretrain.resilience.preemption import parse_signals


@dataclass
class FaultInjectionConfig:
    """Deliberate faults for drills and tests; active on the launcher's first attempt only."""

    kill_rank: int = -1  # SIGKILL this rank at kill_at_step (-1: none)
    kill_at_step: int = -1  # the step of kill_rank/kill_node/kill_during_replication_rank
    kill_node: str | None = None  # SIGKILL every rank on this node at kill_at_step
    # SIGKILL this rank while it receives a replica at kill_at_step (a peer dying mid-replication)
    kill_during_replication_rank: int = -1
    # This rank stops making progress (a hang) at hang_at_step; ft_launcher's heartbeat timeout must catch it
    hang_rank: int = -1
    hang_at_step: int = -1  # the step hang_rank stops at
    # Apply kill_*/hang_* on every attempt, not just the launcher's first (a fault that repeats).
    every_attempt: bool = False
    # Make the save at this step take this many extra seconds (a slow filesystem), inside the
    # checkpointing section: it must not trip the step timeout.
    slow_save_at_step: int = -1
    slow_save_seconds: float = 0.0  # the extra seconds of that save
    # hang_rank hangs in native code (libc pause()) instead of a Python sleep loop.
    hang_native: bool = False
    # The background writer of the tier-1 save at this step: "fail" (an I/O error: reported, training
    # goes on), "hang" (until killed), "slow" or "bug" (a TypeError: a programming error fails the attempt).
    writer_fault_at_step: int = -1
    writer_fault: str | None = None  # fail, hang, slow or bug
    writer_fault_rank: int = 0  # the rank whose writer is faulted
    # The extra seconds of a "slow" writer: long enough for the next save to come due meanwhile
    # at the test's speed (a loaded machine trains several times slower than an idle one).
    writer_slow_seconds: float = 0.6
    # The reshardable tier's forked writer (Megatron's) of the save at writer_fault_at_step on
    # writer_fault_rank: "hang" (it never writes and never ends, until killed from outside).
    staging_writer_fault: str | None = None
    # Raise a (user-code) RuntimeError at raise_at_step: on every rank and every attempt (a
    # deterministic bug), or only on raise_rank in the first attempt (a transient fault).
    raise_rank: int = -1
    raise_at_step: int = -1  # the step of that RuntimeError (-1: none)
    # After restoring this step, overwrite a weight with NaN (a checkpoint that verifies but is poisoned).
    poison_restored_step: int = -1
    # Hold every rank for hold_seconds when it enters a phase of an attempt ("RESTART:PHASE", comma
    # separated, RESTART = the launcher's restart count): a window wide enough for a fault injected
    # from outside the job (tests, drills) to land inside that phase. Phases: pretrain.resilience.phases.PHASES.
    hold_at: str | None = None
    hold_seconds: float = 0.0  # how long hold_at holds the ranks
    # The uploader's S3 client (pretrain upload): kill_after_parts=N (SIGKILL after N multipart
    # parts) or timeout_parts=N (the first N parts time out and are retried).
    s3_fault: str | None = None
    # A directory each rank polls at every step start for a file ``rank-N`` naming a fault to raise
    # inside that rank ("exception" or "gil"): ``pretrain soak`` triggers in-rank faults from outside.
    trigger_dir: str | None = None

    def check(self, fail: Fail) -> None:
        if self.staging_writer_fault not in (None, "hang"):
            fail(
                "staging_writer_fault", f"unknown fault {self.staging_writer_fault!r}", "write hang, or leave it unset"
            )
        if self.writer_slow_seconds < 0:
            fail("writer_slow_seconds", f"{self.writer_slow_seconds:g} is negative", "write 0 or more seconds")
        try:
            parse_holds(self.hold_at)
        except ValueError as exc:
            fail("hold_at", str(exc), "write RESTART:PHASE pairs, e.g. 1:verify,2:load")


@dataclass
class InprocessConfig:
    """NVRx in-process restart: a fault re-runs training in the same processes (seconds)."""

    enabled: bool = False  # wrap training in NVRx's inprocess.Wrapper
    store_port: int | None = None  # the Wrapper's TCP store (+1: process groups); default: free ports rank 0 picks
    keep_host_copy: bool = True  # keep the newest tier-1 step in host memory for a disk-free restore
    monitor_interval: float = 0.1  # seconds between the Wrapper's monitor, heartbeat and progress checks
    last_call_wait: float = 0.1  # seconds to gather other ranks' faults after the first
    soft_timeout: float = 60.0  # no progress for this long: abort and restart in-process
    hard_timeout: float = 90.0  # still stuck: the rank is terminated (the outer launcher restarts it)
    heartbeat_timeout: float = 30.0  # a rank silent for this long is taken for dead
    barrier_timeout: float = 120.0  # bound on the Wrapper's barriers and its store
    # Timeout of every gloo process group of an incarnation (CPU), Megatron's included: a backstop
    # only, a fault aborts collectives in flight at once (the incarnation's connections are shut
    # down). Keep it above the longest legitimate wait (rank skew around saves), below hard_timeout.
    collective_timeout: float = 60.0
    # Timeout of every NCCL process group of an incarnation (GPU). NVRx's usage guide: the NCCL
    # watchdog must fire after hard_timeout, or it terminates the process and no in-process restart
    # happens (its GPU example: 150 s); the Wrapper's abort ends collectives in flight at a fault.
    nccl_timeout: float = 150.0
    # Seconds the Wrapper's CUDA health check (a device synchronize) may take before a restart.
    cuda_health_timeout: float = 30.0

    def group_timeout(self, cuda: bool) -> float:
        """The timeout of an incarnation's process groups: NCCL's on CUDA, gloo's otherwise."""
        return self.nccl_timeout if cuda else self.collective_timeout

    def check(self, fail: Fail) -> None:
        ordered = (
            0 < self.monitor_interval < self.soft_timeout < self.hard_timeout < self.barrier_timeout
            and self.heartbeat_timeout < self.barrier_timeout
            and 0 < self.collective_timeout < self.hard_timeout < self.nccl_timeout
            and self.cuda_health_timeout > 0
        )
        if self.enabled and not ordered:
            fail(
                "",
                "timeouts must satisfy monitor_interval < soft_timeout < hard_timeout < barrier_timeout, "
                "heartbeat_timeout < barrier_timeout, 0 < collective_timeout (gloo) < hard_timeout < "
                "nccl_timeout (NVRx: the NCCL watchdog must not fire before the hard timeout) and "
                f"cuda_health_timeout > 0 (got soft {self.soft_timeout:g}, hard {self.hard_timeout:g}, "
                f"collective {self.collective_timeout:g}, nccl {self.nccl_timeout:g})",
                "order the timeouts",
            )


ACTIONS = ("report", "restart_without")


@dataclass
class StragglerConfig:
    """``fault_tolerance.straggler``: NVRx's straggler detector around the training step
    (pretrain.resilience.stragglers). Every ``report_interval`` steps each rank's comm-free compute
    time is scored against the fastest rank (relative) and its own best (individual); a rank whose
    relative score is below ``threshold`` is reported (log line, ``straggler_score``, events.jsonl).
    With ``action: restart_without`` a node slow in ``patience`` reports in a row is written to the
    run's excluded-nodes file and the job restarts without it."""

    enabled: bool = True  # time each rank's forward and report the slowest ranks
    report_interval: int = 10  # steps between reports (a collective on every rank)
    threshold: float = 0.7  # relative score (fastest rank = 1.0) below which a rank is slow
    patience: int = 3  # consecutive slow reports before ``action`` applies to the rank's node
    # report: name the slow ranks only; restart_without: also exclude a node slow for ``patience``
    # reports in a row (run dir excluded-nodes.jsonl) and end the attempt so the job restarts without it
    action: str = "report"

    def check(self, fail: Fail) -> None:
        positive(fail, report_interval=self.report_interval, patience=self.patience)
        if not 0 < self.threshold <= 1:
            fail("threshold", f"must be in (0, 1], got {self.threshold}", "give a relative score such as 0.7")
        if self.action not in ACTIONS:
            fail("action", f"unknown action {self.action!r}", f"use one of {', '.join(ACTIONS)}")


@dataclass
class FaultToleranceConfig:
    # Send NVRx RankMonitorClient heartbeats when launched under ft_launcher.
    enabled: bool = True
    # Signals that mean "save and leave": SIGTERM (Kubernetes, ft_launcher shutdown), SIGUSR1 (Slurm --signal).
    preemption_signals: str = "SIGTERM,SIGUSR1"
    # Seconds from the signal to a published emergency tier-1 step; past it the rank exits without one.
    # Keep it below the grace period (terminationGracePeriodSeconds, Slurm KillWait, --workers-stop-timeout).
    emergency_save_timeout: float = 30.0
    # Stop the job (attempts/STOP.json) after this many attempts in a row that failed without
    # committing a step newer than the one they restored.
    max_consecutive_failures_without_progress: int = 3
    # Steps after which ft_launcher's heartbeat/section timeouts are measured and set (then saved
    # in checkpoints); 0 keeps the configured ones.
    calculate_timeouts_after: int = 50
    # A NaN/Inf loss or grad norm fails the step; within this many steps after a restore it marks
    # the restored step as poisoned: quarantined everywhere, the next restore uses an older one.
    check_finite: bool = True
    poison_window: int = 20  # steps after a restore in which a non-finite loss poisons the step
    # ``pretrain launch`` starts a standby process beside ft_launcher that has imported torch and
    # Megatron once; every rank start (restarts included) is a fork of it, seconds sooner. It serves
    # only while CUDA is not initialised in it; otherwise ranks import everything themselves.
    standby: bool = True
    # On GPU, seconds a starting rank waits for its GPU's memory to be given back by the rank it
    # replaces (one the kernel still holds, or its forked writer); then it goes on and says so.
    gpu_memory_reclaim_timeout: float = 50.0
    # Seconds a training rank may go without a sign of life while another rank of its node lives
    # before the node's agent kills it (a stopped rank, or one deadlocked with its GIL held), so the
    # launcher restarts the group in seconds. auto: max(3 x the rank's p99 step, 2 s) once
    # calculate_timeouts_after steps ran, where no checkpoint is written on the training thread
    # (off with a thread writer: GPU); 0: off, NVRx's section timeouts alone find hangs.
    hang_watch_s: float | Literal["auto"] = "auto"
    # Seconds another node's checkpoint agent may go without a beat (UDP between the nodes' agents,
    # keyed with the run key) before this node's agent counts that node lost and kills this node's
    # ranks of the attempt, so the launchers restart in seconds instead of after a heartbeat or
    # collective timeout. Multi-node runs only; 0: off.
    node_lost_s: float = 2.0
    inprocess: InprocessConfig = field(default_factory=InprocessConfig)
    inject: FaultInjectionConfig = field(default_factory=FaultInjectionConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)

    def check(self, fail: Fail) -> None:
        if self.max_consecutive_failures_without_progress < 1 or self.poison_window < 0:
            fail(
                "max_consecutive_failures_without_progress",
                "must be >= 1 (and poison_window >= 0)",
                "give a positive number of attempts",
            )
        self.inprocess.check(fail.within("inprocess"))
        if self.emergency_save_timeout <= 0:
            fail("emergency_save_timeout", "must be > 0", "give the seconds the grace period allows")
        watch = self.hang_watch_s
        if watch != "auto" and (isinstance(watch, str) or watch < 0 or 0 < watch < 2.0):
            fail(
                "hang_watch_s",
                f"must be auto, 0 (off) or >= 2 s, got {watch!r}",
                "use auto, 0 or at least 2 (ten pulses: a busy node must not read as a hang)",
            )
        if self.node_lost_s < 0 or 0 < self.node_lost_s < 1.0:
            fail(
                "node_lost_s",
                f"must be 0 (off) or >= 1 s, got {self.node_lost_s!r}",
                "use 0 or at least 1 (five beats: a busy node must not read as lost)",
            )
        if self.gpu_memory_reclaim_timeout < 0:
            fail("gpu_memory_reclaim_timeout", "must be >= 0", "give the seconds to wait (0: do not wait)")
        try:
            parse_signals(self.preemption_signals)
        except ValueError as exc:
            fail("preemption_signals", str(exc), "use names like SIGTERM,SIGUSR1")
        self.inject.check(fail.within("inject"))
        self.straggler.check(fail.within("straggler"))

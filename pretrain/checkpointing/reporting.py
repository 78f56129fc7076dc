"""How a save's outcome is told: the run's events, the Prometheus metrics, the attempt record and
one log line on rank 0. The checkpoint manager calls it; nothing here decides anything except
that ``checkpoint.on_save_error: stop`` turns a failed save into the job's failure."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from pretrain.checkpointing.memory_tier import TierDisabled
from pretrain.checkpointing.state import SaveResult
from pretrain.checkpointing.tier import TierSet
from pretrain.checkpointing.tier_health import DISK_FULL, STALLED, TierStalled
from pretrain.observability.metrics import TrainingMetrics
from pretrain.observability.runlog import RunLog
from pretrain.resilience.attempts import AttemptLog
from tiering.errors import DiskFull

AGENT_GONE_MARK = "checkpoint agent"  # how pretrain.checkpointing.agent.client's AgentGone lines start

log = logging.getLogger("pretrain")

# How a failed save's cause shows in its one line once it crossed ranks as text (a writer's
# OSError, another rank's DiskFull): the metric's reason label.
_DISK_FULL = ("disk full", "no space left on device", "disk quota exceeded")


def failure_reason(exc: BaseException) -> str:
    """``disk_full``, ``stalled``, ``agent_gone``, ``timeout`` or ``error``: the ``reason`` of
    ``checkpoint_save_failures_total``."""
    text = str(exc).lower()
    if isinstance(exc, DiskFull) or any(marker in text for marker in _DISK_FULL):
        return DISK_FULL
    if isinstance(exc, TierStalled) or re.search(rf"\b{STALLED}\b", text):
        return STALLED
    if AGENT_GONE_MARK in text:  # the node's checkpoint agent did not answer (training goes on with tier 0)
        return "agent_gone"
    if "timed out" in text or "deadline" in text:
        return "timeout"
    return "error"


@dataclass
class SaveReport:
    tiers: TierSet
    runlog: RunLog
    metrics: TrainingMetrics
    records: AttemptLog
    rank: int
    stop_on_error: bool  # checkpoint.on_save_error: stop

    def queue_changed(self) -> None:
        self.metrics.queued(self.tiers.in_flight_count())

    def saved(self, saved: SaveResult, current_step: int) -> None:
        self.tiers.committed(saved.step)
        self.metrics.tier_healthy(saved.tier, True)
        self.metrics.saved(saved.tier, saved.seconds)
        fields = ("tier", "step", "seconds", "blocked_seconds", "bytes", "replication_seconds", "under_replicated")
        # Tier 0 saves every step or so: its event is not fsynced (the next one supersedes it).
        self.runlog.event("save", durable=saved.tier != "memory", **{k: getattr(saved, k) for k in fields})
        self.records.progress(current_step, **{f"last_saved_{saved.tier}": saved.step})
        if saved.peer_skipped:  # the stream's own log line says so; the metric counts every slot
            self.metrics.save_skipped("memory_peer", saved.peer_skipped)
        if self.rank == 0 and saved.tier != "memory":  # tier 0 saves every step or so: its log is the event
            extra = f" + replication {saved.replication_seconds:.2f}s" if saved.tier == "local" else ""
            blocked = f" (training blocked {saved.blocked_seconds:.3f}s)" if saved.blocked_seconds is not None else ""
            log.info(
                "saved step %d to tier %s: %.1f MB in %.2fs%s%s",
                saved.step,
                saved.tier,
                saved.bytes / 1e6,
                saved.seconds,
                extra,
                blocked,
            )

    def failed(self, tier: str, step: int, exc: Exception) -> None:
        """The step is not published in this tier; older steps are intact. Training goes on (the
        next interval tries again) unless checkpoint.on_save_error is stop. Tier 0 turning itself
        off (a full tmpfs) is one warning and a metric, and never stops the job."""
        reason = failure_reason(exc)
        if reason == STALLED:
            self.metrics.tier_healthy(tier, False)
        if isinstance(exc, TierStalled):  # skipped while stalled: the stall itself was reported
            log.debug("%s", exc)
            self.runlog.event("save_skipped", tier=tier, step=step, reason=reason, error=str(exc))
            self.metrics.save_skipped(tier)
            return
        if isinstance(exc, TierDisabled):
            if self.rank == 0:
                log.warning("%s", exc)
            self.runlog.event("tier_disabled", tier=tier, step=step, error=str(exc), reason=reason)
            self.metrics.save_failed(tier, reason)
            return
        log.error("checkpoint of step %d failed: %s", step, exc)
        self.runlog.event("save_failed", tier=tier, step=step, error=str(exc), reason=reason)
        self.metrics.save_failed(tier, reason)
        if self.stop_on_error:
            raise exc

    def skipped(self, tier: str, step: int, in_flight: int | None) -> None:
        log.warning("%s save of step %d skipped: step %s is still being written", tier, step, in_flight)
        self.runlog.event("save_skipped", tier=tier, step=step, in_flight=in_flight)
        self.metrics.save_skipped(tier)

"""Prometheus metrics of the rank program, served by rank 0 on ``metrics.port`` (``/metrics``).

Every series is a ``prometheus_client`` metric (Gauge, Counter, Histogram) in this object's own
registry, labelled with the run id. Values that must survive a restart (restarts, lost steps, steps
and tokens run) are rebuilt from the attempt records when an attempt starts, so they stay monotonic
across processes: Prometheus sees a counter that kept growing while the job was down, not a reset
that ``increase()`` would count twice. Everything else describes the current attempt. A series with
no value yet (the recovery time before a recovery, the validation loss before an evaluation) is
absent, not zero.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)
disable_created_metrics()  # no *_created series: restarts rebuild the counters, their creation time means nothing

# Save/load durations span ~10 ms (a tiny local step) to many minutes (a large model to S3).
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class TrainingMetrics(Collector):
    """The training loop and the checkpoint manager update it; a scrape reads its registry. It is a
    collector itself, so a test or another registry can collect it directly."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._tokens_per_step = 0
        self._history_steps = 0  # steps of earlier attempts: their tokens count once the step size is known
        self.planned_interval_steps: dict[str, int] = {}
        self._step_seconds_ema: float | None = None
        self._last_step_time: float | None = None
        run, tier = ["run_id"], ["run_id", "tier"]
        r = self.registry
        self._last_success = Gauge(
            "checkpoint_last_success_timestamp_seconds",
            "Unix time of the newest committed checkpoint of each tier (this attempt)",
            tier,
            registry=r,
        )
        self._planned = Gauge(
            "checkpoint_planned_interval_seconds",
            "Planned seconds between checkpoints of each tier (interval in steps x measured step time)",
            tier,
            registry=r,
        )
        self._save_seconds = Histogram(
            "checkpoint_save_duration_seconds", "Seconds to publish a checkpoint, per tier", tier,
            buckets=DURATION_BUCKETS, registry=r,
        )  # fmt: skip
        self._load_seconds = Histogram(
            "checkpoint_load_duration_seconds", "Seconds to restore a checkpoint, per tier", tier,
            buckets=DURATION_BUCKETS, registry=r,
        )  # fmt: skip
        self._save_failures = Counter(
            "checkpoint_save_failures",
            "Checkpoint saves that were not published, by reason (disk_full, stalled, timeout, error)",
            [*tier, "reason"],
            registry=r,
        )
        self._tier_healthy = Gauge(
            "checkpoint_tier_healthy",
            "1 while a tier's storage answers, 0 once a save there passed its stall deadline (until it answers again)",
            tier,
            registry=r,
        )
        self._save_skips = Counter(
            "checkpoint_save_skips", "Saves skipped because one was still in flight", tier, registry=r
        )
        self._queue = Gauge("checkpoint_async_queue_depth", "Saves in flight in the background writer", run, registry=r)
        self._uncommitted = Gauge(
            "checkpoint_uncommitted_versions", "Checkpoint versions written but not yet committed", run, registry=r
        )
        self._restarts = Counter(
            "training_restarts", "Attempts of this run that ended early, by kind", [*run, "kind"], registry=r
        )
        self._lost = Counter("training_lost_steps", "Steps recomputed after restores", run, registry=r)
        self._recovery = Gauge(
            "training_recovery_seconds",
            "Last recovery: failed attempt's last sign of life to this attempt's first step",
            run,
            registry=r,
        )
        self._steps = Counter("training_steps", "Training steps run (recomputed steps included)", run, registry=r)
        self._tokens = Counter("training_tokens", "Tokens trained on (recomputed steps included)", run, registry=r)
        self._step = Gauge("training_step", "The step the model is at", run, registry=r)
        self._validation_loss = Gauge("validation_loss", "Validation loss at the newest evaluation", run, registry=r)
        self._validation_step = Gauge("validation_step", "The step of the newest evaluation", run, registry=r)
        self._straggler = Gauge(
            "straggler_score",
            "Relative compute speed of each rank at the newest straggler report (fastest rank = 1)",
            [*run, "rank", "node"],
            registry=r,
        )
        # Series every scrape shows from the start (zero until something happens).
        for metric in (self._queue, self._uncommitted, self._lost, self._steps, self._tokens, self._step):
            metric.labels(run_id)

    def collect(self) -> Iterable[Metric]:
        return self.registry.collect()

    @property
    def tokens_per_step(self) -> int:
        return self._tokens_per_step

    @tokens_per_step.setter
    def tokens_per_step(self, tokens: int) -> None:
        self._tokens.labels(self.run_id).inc(self._history_steps * (tokens - self._tokens_per_step))
        self._tokens_per_step = tokens

    # -- updates from the training loop ---------------------------------------------------------
    def from_history(self, previous: list[dict[str, Any]]) -> None:
        """Counters carried over from earlier attempts' records."""
        for rec in previous:
            first, last = rec.get("first_step"), rec.get("last_step")
            if first is not None and last is not None and last >= first:
                self._steps.labels(self.run_id).inc(last - first + 1)
                self._history_steps += last - first + 1
                self._tokens.labels(self.run_id).inc((last - first + 1) * self._tokens_per_step)
            self._lost.labels(self.run_id).inc(rec.get("lost_steps") or 0)
            if rec.get("status") not in ("running", "succeeded"):
                failure = rec.get("failure") or {}
                kind = "preempted" if rec.get("status") == "preempted" else failure.get("classification")
                self._restarts.labels(self.run_id, kind or "unknown").inc()

    def recovered(self, lost_steps: int | None, rto: float | None) -> None:
        self._lost.labels(self.run_id).inc(lost_steps or 0)
        if rto is not None:
            self._recovery.labels(self.run_id).set(rto)

    def stepped(self, step: int) -> None:
        now = time.monotonic()
        with self._lock:
            if self._last_step_time is not None:
                dt = now - self._last_step_time
                ema = self._step_seconds_ema
                self._step_seconds_ema = dt if ema is None else 0.9 * ema + 0.1 * dt
            self._last_step_time = now
            ema = self._step_seconds_ema
        self._step.labels(self.run_id).set(step)
        self._steps.labels(self.run_id).inc()
        self._tokens.labels(self.run_id).inc(self._tokens_per_step)
        if ema is not None:
            for tier, steps in self.planned_interval_steps.items():
                self._planned.labels(self.run_id, tier).set(steps * ema)

    def validated(self, step: int, loss: float) -> None:
        self._validation_loss.labels(self.run_id).set(loss)
        self._validation_step.labels(self.run_id).set(step)

    def straggler_score(self, rank: int, node: str, score: float) -> None:
        self._straggler.labels(self.run_id, str(rank), node).set(score)

    def saved(self, tier: str, seconds: float) -> None:
        self._last_success.labels(self.run_id, tier).set(time.time())
        self._save_seconds.labels(self.run_id, tier).observe(seconds)

    def save_failed(self, tier: str, reason: str = "error") -> None:
        self._save_failures.labels(self.run_id, tier, reason).inc()

    def tier_healthy(self, tier: str, healthy: bool) -> None:
        self._tier_healthy.labels(self.run_id, tier).set(1 if healthy else 0)

    def save_skipped(self, tier: str, count: int = 1) -> None:
        self._save_skips.labels(self.run_id, tier).inc(count)

    def loaded(self, tier: str, seconds: float) -> None:
        self._load_seconds.labels(self.run_id, tier).observe(seconds)

    def queued(self, in_flight: int) -> None:
        """Background saves in flight (each is a version written but not yet committed)."""
        self._queue.labels(self.run_id).set(in_flight)
        self._uncommitted.labels(self.run_id).set(in_flight)


class MetricsServer:
    """Serves one :class:`TrainingMetrics` over HTTP from a daemon thread."""

    def __init__(self, metrics: TrainingMetrics, host: str, port: int) -> None:
        self.server, self.thread = start_http_server(port, addr=host, registry=metrics.registry)
        log.info("metrics on http://%s:%d/metrics", host, port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

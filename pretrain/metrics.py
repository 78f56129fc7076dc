"""Prometheus metrics of the rank program, served by rank 0 on ``metrics.port`` (``/metrics``).

Values that must survive a restart (restarts, lost steps, steps run) are rebuilt from the
attempt records when an attempt starts, so they stay monotonic across processes: Prometheus sees
a counter that kept growing while the job was down, not a reset that ``increase()`` would count
twice. Everything else describes the current attempt.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter as Tally
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

log = logging.getLogger(__name__)

# Save/load durations span ~10 ms (a tiny local step) to many minutes (a large model to S3).
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


@dataclass
class _Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * len(DURATION_BUCKETS))
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(DURATION_BUCKETS):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.n += 1


class TrainingMetrics:
    """Thread-safe state behind the exporter; the training loop updates it, scrapes read it."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._lock = threading.Lock()
        self.last_success: dict[str, float] = {}
        self.planned_interval_steps: dict[str, int] = {}
        self.save_seconds: dict[str, _Histogram] = {}
        self.load_seconds: dict[str, _Histogram] = {}
        self.save_failures: Tally[tuple[str, str]] = Tally()  # (tier, reason)
        self.save_skips: Tally[str] = Tally()
        self.queue_depth = 0
        self.uncommitted = 0
        self.restarts: Tally[str] = Tally()
        self.lost_steps = 0
        self.recovery_seconds: float | None = None
        self.steps_before = 0  # steps run by earlier attempts (recomputed steps included)
        self.steps_now = 0
        self.tokens_per_step = 0
        self.step = 0
        self._step_seconds_ema: float | None = None
        self._last_step_time: float | None = None
        self.validation: tuple[int, float] | None = None  # (step, loss) of the newest evaluation

    # -- updates from the training loop ---------------------------------------------------------
    def from_history(self, previous: list[dict[str, Any]]) -> None:
        """Counters carried over from earlier attempts' records."""
        with self._lock:
            for rec in previous:
                first, last = rec.get("first_step"), rec.get("last_step")
                if first is not None and last is not None and last >= first:
                    self.steps_before += last - first + 1
                self.lost_steps += rec.get("lost_steps") or 0
                if rec.get("status") not in ("running", "succeeded"):
                    failure = rec.get("failure") or {}
                    kind = "preempted" if rec.get("status") == "preempted" else failure.get("classification")
                    self.restarts[kind or "unknown"] += 1

    def recovered(self, lost_steps: int | None, rto: float | None) -> None:
        with self._lock:
            self.lost_steps += lost_steps or 0
            if rto is not None:
                self.recovery_seconds = rto

    def stepped(self, step: int) -> None:
        now = time.monotonic()
        with self._lock:
            if self._last_step_time is not None:
                dt = now - self._last_step_time
                ema = self._step_seconds_ema
                self._step_seconds_ema = dt if ema is None else 0.9 * ema + 0.1 * dt
            self._last_step_time = now
            self.step = step
            self.steps_now += 1

    def validated(self, step: int, loss: float) -> None:
        with self._lock:
            self.validation = (step, loss)

    def saved(self, tier: str, seconds: float) -> None:
        with self._lock:
            self.last_success[tier] = time.time()
            self.save_seconds.setdefault(tier, _Histogram()).observe(seconds)

    def save_failed(self, tier: str, reason: str = "error") -> None:
        with self._lock:
            self.save_failures[(tier, reason)] += 1

    def save_skipped(self, tier: str) -> None:
        with self._lock:
            self.save_skips[tier] += 1

    def loaded(self, tier: str, seconds: float) -> None:
        with self._lock:
            self.load_seconds.setdefault(tier, _Histogram()).observe(seconds)

    # -- the collector --------------------------------------------------------------------------
    def collect(self) -> Any:
        labels = ["run_id"]
        with self._lock:
            rid = [self.run_id]
            g = GaugeMetricFamily(
                "checkpoint_last_success_timestamp_seconds",
                "Unix time of the newest committed checkpoint of each tier (this attempt)",
                labels=[*labels, "tier"],
            )
            for tier, ts in sorted(self.last_success.items()):
                g.add_metric([*rid, tier], ts)
            yield g
            g = GaugeMetricFamily(
                "checkpoint_planned_interval_seconds",
                "Planned seconds between checkpoints of each tier (interval in steps x measured step time)",
                labels=[*labels, "tier"],
            )
            if self._step_seconds_ema is not None:
                for tier, steps in sorted(self.planned_interval_steps.items()):
                    g.add_metric([*rid, tier], steps * self._step_seconds_ema)
            yield g
            for name, doc, hists in (
                ("checkpoint_save_duration_seconds", "Seconds to publish a checkpoint, per tier", self.save_seconds),
                ("checkpoint_load_duration_seconds", "Seconds to restore a checkpoint, per tier", self.load_seconds),
            ):
                h = HistogramMetricFamily(name, doc, labels=[*labels, "tier"])
                for tier, hist in sorted(hists.items()):
                    buckets = [(str(b), c) for b, c in zip(DURATION_BUCKETS, hist.counts)] + [("+Inf", hist.n)]
                    h.add_metric([*rid, tier], buckets, hist.total)
                yield h
            c = CounterMetricFamily(
                "checkpoint_save_failures",
                "Checkpoint saves that were not published, by reason (disk_full, timeout, error)",
                labels=[*labels, "tier", "reason"],
            )
            for (tier, reason), n in sorted(self.save_failures.items()):
                c.add_metric([*rid, tier, reason], n)
            yield c
            c = CounterMetricFamily(
                "checkpoint_save_skips", "Saves skipped because one was still in flight", labels=[*labels, "tier"]
            )
            for tier, n in sorted(self.save_skips.items()):
                c.add_metric([*rid, tier], n)
            yield c
            g = GaugeMetricFamily(
                "checkpoint_async_queue_depth", "Saves in flight in the background writer", labels=labels
            )
            g.add_metric(rid, self.queue_depth)
            yield g
            g = GaugeMetricFamily(
                "checkpoint_uncommitted_versions", "Checkpoint versions written but not yet committed", labels=labels
            )
            g.add_metric(rid, self.uncommitted)
            yield g
            c = CounterMetricFamily(
                "training_restarts", "Attempts of this run that ended early, by kind", labels=[*labels, "kind"]
            )
            for kind, n in sorted(self.restarts.items()):
                c.add_metric([*rid, kind], n)
            yield c
            c = CounterMetricFamily("training_lost_steps", "Steps recomputed after restores", labels=labels)
            c.add_metric(rid, self.lost_steps)
            yield c
            g = GaugeMetricFamily(
                "training_recovery_seconds",
                "Last recovery: failed attempt's last sign of life to this attempt's first step",
                labels=labels,
            )
            if self.recovery_seconds is not None:
                g.add_metric(rid, self.recovery_seconds)
            yield g
            steps = self.steps_before + self.steps_now
            c = CounterMetricFamily("training_steps", "Training steps run (recomputed steps included)", labels=labels)
            c.add_metric(rid, steps)
            yield c
            c = CounterMetricFamily("training_tokens", "Tokens trained on (recomputed steps included)", labels=labels)
            c.add_metric(rid, steps * self.tokens_per_step)
            yield c
            g = GaugeMetricFamily("training_step", "The step the model is at", labels=labels)
            g.add_metric(rid, self.step)
            yield g
            yield from self._validation_metrics(labels, rid)

    def _validation_metrics(self, labels: list[str], rid: list[str]) -> Any:
        if self.validation is None:
            return
        g = GaugeMetricFamily("validation_loss", "Validation loss at the newest evaluation", labels=labels)
        g.add_metric(rid, self.validation[1])
        yield g
        g = GaugeMetricFamily("validation_step", "The step of the newest evaluation", labels=labels)
        g.add_metric(rid, self.validation[0])
        yield g


class MetricsServer:
    """Serves one :class:`TrainingMetrics` over HTTP from a daemon thread."""

    def __init__(self, metrics: TrainingMetrics, host: str, port: int) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(metrics)
        self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)
        log.info("metrics on http://%s:%d/metrics", host, port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

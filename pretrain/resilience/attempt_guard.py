"""The frame around one attempt: open its record, decide whether it may run at all, and leave
evidence of how it ended.

:func:`open_attempt` (collective) agrees on the attempt id, refuses a stopped run
(``attempts/STOP.json``), opens ``attempt-NN.json`` (closing a previous one that died open),
stops the job when the same failure keeps repeating without progress, installs the preemption
handlers and starts the metrics exporter. :func:`fail_attempt` classifies the exception that
ended this rank, writes its failure report and closes the record; a deterministic failure
confirmed by the previous attempt stops the job instead of burning the restart budget; a
straggler exclusion (:class:`~pretrain.errors.StragglerExcluded`) closes the record as ``excluded``
and stops the local launcher, so the job restarts without the node.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.config import FaultToleranceConfig, MetricsConfig, RunConfig
from pretrain.errors import JobStopped, PreemptedError, StragglerExcluded
from pretrain.observability.goodput import GoodputCollector
from pretrain.observability.metrics import MetricsServer, TrainingMetrics
from pretrain.observability.runlog import run_dir
from pretrain.resilience.attempts import AttemptLog, record_failure
from pretrain.resilience.failures import FailureInfo, classify
from pretrain.resilience.job_policy import (
    confirmed_deterministic,
    failures_without_progress,
    refuse_if_stopped,
    stop_local_launcher,
    write_stop,
)
from pretrain.resilience.phases import PhaseRecord
from pretrain.resilience.preemption import PreemptionWatch, parse_signals
from pretrain.resilience.restarts import launcher_restart_count, restart_counters
from tiering.collective import Collective
from tiering.errors import CheckpointError

log = logging.getLogger("pretrain")


@dataclass
class AttemptContext:
    """What one attempt carries besides the session: its record, signals, metrics and history."""

    id: str
    rank: int
    run_dir: Path
    records: AttemptLog
    watch: PreemptionWatch
    metrics: TrainingMetrics
    previous_failure: dict[str, Any] | None
    phases: PhaseRecord | None = None
    server: MetricsServer | None = None
    on_abort: list[Callable[[], None]] = field(default_factory=list)


def _stop_decision(ft: FaultToleranceConfig, records: AttemptLog) -> str | None:
    """Rank 0: the reason to stop the job now (the same failure repeating without progress)."""
    limit = ft.max_consecutive_failures_without_progress
    stalled = failures_without_progress(records.history)
    if stalled < limit:
        return None
    last = (records.history[-1].get("failure") or {}) if records.history else {}
    return (
        f"{stalled} attempts in a row failed without committing a new checkpoint, the same way each time "
        f"(fault_tolerance.max_consecutive_failures_without_progress={limit};"
        f" last failure: {last.get('classification')}: {last.get('exception') or last.get('evidence')})"
    )


def _refuse_if_stopped(rank: int, rdir: Path, coll: Collective) -> None:
    refused = None
    if rank == 0:
        try:
            refuse_if_stopped(rdir)
        except JobStopped as exc:
            refused = exc.message
    refused = coll.broadcast(refused)
    if refused:
        log.error("%s", refused)
        raise JobStopped(refused)


def _metrics_server(settings: MetricsConfig, metrics: TrainingMetrics) -> MetricsServer | None:
    if not settings.enabled:
        return None
    try:
        return MetricsServer(metrics, settings.host, settings.port)
    except OSError as exc:  # metrics must never stop training
        log.warning("metrics: cannot serve on %s:%d (%s); continuing without", settings.host, settings.port, exc)
        return None


def open_attempt(
    run: RunConfig,
    ft: FaultToleranceConfig,
    metrics_settings: MetricsConfig,
    rank: int,
    world: int,
    coll: Collective,
    phases: PhaseRecord | None,
) -> AttemptContext:
    """Collective: see the module docstring. Raises JobStopped when the run must not go on."""
    attempt = coll.broadcast(f"attempt-{launcher_restart_count():02d}-{uuid.uuid4().hex[:8]}")
    hosts = coll.all_gather(socket.gethostname())
    if phases is not None:
        phases.attempt = attempt
    rdir = run_dir(run.dir, run.id)
    _refuse_if_stopped(rank, rdir, coll)
    records = AttemptLog(rdir, enabled=rank == 0)
    records.begin(attempt, world, hosts, restart_counters())
    decision = _stop_decision(ft, records) if rank == 0 else None
    if decision:
        write_stop(rdir, decision, attempt=records.record.get("attempt"))
        records.end("stopped", None, stop_reason=decision)
    decision = coll.broadcast(decision)
    if decision:
        log.error("stopping the job: %s", decision)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            stop_local_launcher()
        raise JobStopped(decision)
    previous_failure = coll.broadcast((records.previous or {}).get("failure") if rank == 0 else None)

    def deadline_passed(message: str) -> None:  # runs on the watchdog thread, just before os._exit
        log.error("%s", message)
        record_failure(rdir, attempt, rank, classify(PreemptedError(message)))
        records.end("preempted", None, emergency=message)

    watch = PreemptionWatch(
        parse_signals(ft.preemption_signals),
        ft.emergency_save_timeout,
        deadline_passed,
        on_signal=phases.mark_signal if phases is not None else lambda name: None,
    )
    metrics = TrainingMetrics(run.id)
    server = None
    if rank == 0:
        metrics.from_history(records.history)
        metrics.registry.register(GoodputCollector(rdir, run.id))  # from the records, at each scrape
        server = _metrics_server(metrics_settings, metrics)
    return AttemptContext(attempt, rank, rdir, records, watch, metrics, previous_failure, phases, server)


def fail_attempt(ctx: AttemptContext, exc: BaseException) -> None:
    """This rank's attempt ended with ``exc``: clean up, report, close the record; raises
    JobStopped when the failure is deterministic and confirmed (the caller re-raises ``exc`` otherwise)."""
    for abort in ctx.on_abort:
        try:
            abort()  # e.g. stop a background writer: its step will not be committed
        except Exception as abort_exc:  # the failure itself must still be recorded
            log.warning("rank %d: cleanup after the failure failed: %s", ctx.rank, abort_exc)
    with ctx.watch.ending():
        _end_failed_attempt(ctx, exc)


def _end_failed_attempt(ctx: AttemptContext, exc: BaseException) -> None:
    info = classify(exc)
    if ctx.watch.requested and _storage_failure(exc, info):
        # Told to leave, and the way out failed on storage: still a preemption, not an error to
        # confirm by a second attempt (a soak recorded a SIGTERM to the launcher as rank 1's
        # exception). A programming error stays one, and so does a lost peer (see _storage_failure).
        exc = _preempted_on_the_way_out(ctx, info)
        info = classify(exc)
    record_failure(ctx.run_dir, ctx.id, ctx.rank, info)
    if isinstance(exc, PreemptedError):
        return
    if isinstance(exc, StragglerExcluded):
        # Every rank leaves at the same step; the local launcher must not restart on this node set.
        ctx.records.end("excluded", exc.step, info, excluded_node=exc.node)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            stop_local_launcher()
        return
    log.error("rank %d failed (%s): %s", ctx.rank, info.classification, info.exception)
    # A rank 0 that only saw a peer vanish leaves the diagnosis to the next attempt.
    ctx.records.end("failed", None, None if info.peer_lost else info)
    if confirmed_deterministic(info, ctx.previous_failure):
        reason = f"the same {info.classification} error ended two attempts in a row: {info.exception}"
        log.error("not retrying: %s", reason)
        write_stop(ctx.run_dir, reason, rank=ctx.rank)
        stop_local_launcher()
        raise JobStopped(reason) from exc


def _storage_failure(exc: BaseException, info: FailureInfo) -> bool:
    """A storage failure, not a lost peer: the launcher stopping a failed group sends the survivors
    SIGTERM too, and their lost-peer errors must stay what they are (a soak read the kill of rank 1
    as a preemption of rank 0)."""
    if isinstance(exc, PreemptedError) or info.peer_lost:
        return False
    return isinstance(exc, CheckpointError | OSError)


def _preempted_on_the_way_out(ctx: AttemptContext, failed: FailureInfo) -> PreemptedError:
    outcome = f"emergency save not published: {failed.exception}"
    log.warning("rank %d: %s received; %s", ctx.rank, ctx.watch.signal_name, outcome)
    ctx.records.end("preempted", None, signal=ctx.watch.signal_name, emergency=outcome, emergency_published=False)
    return PreemptedError(f"{ctx.watch.signal_name}: {outcome}")


def close_attempt(ctx: AttemptContext) -> None:
    ctx.watch.uninstall()
    if ctx.server is not None:
        ctx.server.close()

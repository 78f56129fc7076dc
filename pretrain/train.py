"""The rank program: Megatron Core GPT pretraining with verified checkpoints and exact resume."""

from __future__ import annotations

import datetime
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pretrain import cpu_shims
from pretrain.config import Config, data_parallel_size, validate
from pretrain.errors import JobStopped, NonFiniteError, PreemptedError
from pretrain.metrics import TrainingMetrics
from pretrain.resilience.attempts import AttemptLog, record_failure
from pretrain.resilience.failures import classify
from pretrain.resilience.job_policy import (
    confirmed_deterministic,
    failures_without_progress,
    refuse_if_stopped,
    stop_local_launcher,
    write_stop,
)
from pretrain.resilience.phases import PhaseRecord, parse_holds
from pretrain.resilience.preemption import PreemptionWatch, parse_signals
from pretrain.resilience.rank_monitor import (
    RankMonitor,
    launcher_restart_count,
    maybe_inject_fault,
    maybe_poison_restored,
    maybe_slow_save,
    restart_counters,
)
from pretrain.runlog import RunLog, append_jsonl, run_dir

log = logging.getLogger("pretrain")


@dataclass
class RunSummary:
    attempt: str
    first_step: int
    last_step: int
    restored_step: int | None
    restore_seconds: float
    steps_per_second: float


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )


def train(cfg: Config) -> RunSummary:
    """Run (or resume) training to ``train.steps``. Must run under torchrun/ft_launcher (or 1 rank)."""
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    setup_logging(rank)
    cuda = torch.cuda.is_available()
    validate(cfg, world, cuda)  # before any process group exists
    cpu_shims.install()
    inj = cfg.fault_tolerance.inject
    phases = PhaseRecord(run_dir(cfg.run.dir, cfg.run.id), rank, parse_holds(inj.hold_at), inj.hold_seconds)
    phases.mark_signals_until_replaced()
    phases.enter("startup")

    if cfg.fault_tolerance.inprocess.enabled:
        from pretrain.resilience.inprocess import run_inprocess

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29555")
        return run_inprocess(cfg, lambda: _train_in_group(cfg, _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), phases))
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # a plain single-process run
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29555")
        backend = "nccl" if cuda else "gloo"
        if cuda:
            torch.cuda.set_device(_env_int("LOCAL_RANK", 0))
        phases.enter("rendezvous")
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10))
    try:
        return _train_in_group(cfg, rank, world, phases)
    finally:
        from megatron.core import parallel_state

        from pretrain.checkpointing.reshardable import wait_for_writer_warmup

        wait_for_writer_warmup()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@dataclass
class Session:
    """Everything one incarnation of the rank program builds before its first step."""

    cfg: Config
    rank: int
    world: int
    attempt: str
    ddp: Any
    dataset: Any
    state: Any  # pretrain.checkpointing.state.TrainingState
    ckpt: Any  # pretrain.checkpointing.tiered.TieredCheckpointer
    runlog: RunLog
    monitor: RankMonitor
    phases: PhaseRecord | None = None


def build_session(cfg: Config, rank: int, world: int, attempt: str, phases: PhaseRecord | None = None) -> Session:
    """Parallel state, data, model, optimizer, scheduler and checkpoint manager (no restore yet)."""
    # Imports that pull in Megatron come after validation so that bad configs fail fast.
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from pretrain.checkpointing.state import TrainingState
    from pretrain.checkpointing.tiered import TieredCheckpointer
    from pretrain.data.dataset import GlobalBatchSampler, build_train_dataset
    from pretrain.data.prepare import dataset_snapshot_id
    from pretrain.model import build_model, resolve_spec_name, transformer_config
    from pretrain.optim import build_optimizer, build_scheduler, uses_distributed_optimizer
    from pretrain.rank_state import seed_everything
    from tiering.collective import TorchCollective

    monitor = RankMonitor(cfg)
    monitor.start("setup")  # ends once the restore is done
    if phases is not None:
        phases.enter("monitor", monitor=monitor.active, monitor_wedged=monitor.wedged)
    p = cfg.parallel
    if not parallel_state.model_parallel_is_initialized():
        ipc = cfg.fault_tolerance.inprocess
        # In-process restarts: Megatron's groups get the incarnation's collective timeout (a
        # backstop: the restart's abort fails collectives in flight at once).
        timeout_min = ipc.collective_timeout / 60.0 if ipc.enabled else 30
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp, distributed_timeout_minutes=timeout_min
        )
    coll = TorchCollective()
    runlog = RunLog(cfg.run.dir, cfg.run.id, attempt, enabled=rank == 0)
    dp = data_parallel_size(cfg, world)
    topology = {"tp": p.tp, "pp": p.pp, "dp": dp, "world_size": world}

    seed_everything(cfg.train.seed + 100 * parallel_state.get_pipeline_model_parallel_rank())
    dataset = build_train_dataset(cfg)
    tconfig = transformer_config(cfg)
    model = build_model(cfg, tconfig)
    ddp = DistributedDataParallel(
        tconfig,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=uses_distributed_optimizer(cfg),
        ),
        model,
    )
    tconfig.finalize_model_grads_func = finalize_model_grads
    tconfig.no_sync_func = ddp.no_sync
    optimizer = build_optimizer(cfg, ddp)
    scheduler = build_scheduler(cfg, optimizer)
    sampler = GlobalBatchSampler(
        len(dataset),
        cfg.data.global_batch_size,
        cfg.data.micro_batch_size,
        parallel_state.get_data_parallel_rank(),
        dp,
        cfg.train.seed,
    )
    state = TrainingState(cfg, model, optimizer, scheduler, sampler, topology, dataset_snapshot_id(cfg.data.prefix))
    if rank == 0:
        log.info(
            "model: %s spec, %d params on rank 0, topology %s, %d samples/epoch",
            resolve_spec_name(cfg),
            sum(t.numel() for t in model.parameters()),
            topology,
            len(dataset),
        )
    from pretrain.resilience.inprocess import incarnation

    runlog.event(
        "start",
        rank_count=world,
        incarnation=incarnation(),
        pids=coll.all_gather(os.getpid()),
        topology=topology,
        launcher_restart_count=launcher_restart_count(),
        host=os.uname().nodename,
    )
    if monitor.wedged:
        runlog.event("rank_monitor_wedged", force=True, rank=rank, host=os.uname().nodename)
    ckpt = TieredCheckpointer(cfg, coll, attempt, topology, record_event=runlog.event, phases=phases)
    return Session(cfg, rank, world, attempt, ddp, dataset, state, ckpt, runlog, monitor, phases)


def restore_latest(session: Session) -> Any:
    """Collective: load the newest verified checkpoint into the session; None if there is none."""
    session.ckpt.prepare()
    restored = session.ckpt.restore(session.state) if session.cfg.checkpoint.load else None
    if restored is not None:
        log.info(
            "restored step %d from tier %s in %.2fs (verify %.2fs, rng %s); resuming at step %d",
            restored.step,
            restored.tier,
            restored.seconds,
            restored.verify_seconds,
            "restored" if restored.rng_restored else "re-seeded",
            restored.step + 1,
        )
        session.runlog.event(
            "restore",
            tier=restored.tier,
            step=restored.step,
            seconds=restored.seconds,
            verify_seconds=restored.verify_seconds,
            rng_restored=restored.rng_restored,
            rejected=[{"step": s, "reason": r} for s, r in restored.rejected],
            per_rank=restored.per_rank,
            notes=restored.notes,
        )
    else:
        log.info("no verified checkpoint: starting from step 0")
        session.runlog.event("fresh_start")
    return restored


@dataclass
class AttemptContext:
    """What one attempt carries besides the session: its record, signals, metrics and history."""

    id: str
    run_dir: Path
    records: AttemptLog
    watch: PreemptionWatch
    metrics: TrainingMetrics
    previous_failure: dict[str, Any] | None
    phases: PhaseRecord | None = None
    on_abort: list[Callable[[], None]] = field(default_factory=list)


def _train_in_group(cfg: Config, rank: int, world: int, phases: PhaseRecord | None = None) -> RunSummary:
    """One attempt: open its record, decide whether it may run, run it, leave evidence of its end."""
    from pretrain.metrics import MetricsServer
    from tiering.collective import TorchCollective

    coll = TorchCollective()
    attempt = coll.broadcast(f"attempt-{launcher_restart_count():02d}-{uuid.uuid4().hex[:8]}")
    hosts = coll.all_gather(socket.gethostname())
    if phases is not None:
        phases.attempt = attempt
    rdir = run_dir(cfg.run.dir, cfg.run.id)
    ft = cfg.fault_tolerance
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
    records = AttemptLog(rdir, enabled=rank == 0)
    records.begin(attempt, world, hosts, restart_counters())
    decision = None
    if rank == 0:
        stalled = failures_without_progress(records.history)
        if stalled >= ft.max_consecutive_failures_without_progress:
            last = (records.history[-1].get("failure") or {}) if records.history else {}
            decision = (
                f"{stalled} attempts in a row failed without committing a new checkpoint "
                f"(fault_tolerance.max_consecutive_failures_without_progress={ft.max_consecutive_failures_without_progress};"
                f" last failure: {last.get('classification')}: {last.get('exception') or last.get('evidence')})"
            )
            write_stop(rdir, decision, attempt=records.record.get("attempt"))
            records.end("stopped", None, stop_reason=decision)
    decision = coll.broadcast(decision)
    if decision:
        log.error("stopping the job: %s", decision)
        if _env_int("LOCAL_RANK", 0) == 0:
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
    metrics = TrainingMetrics(cfg.run.id)
    server = None
    if rank == 0:
        metrics.from_history(records.history)
        if cfg.metrics.enabled:
            try:
                server = MetricsServer(metrics, cfg.metrics.host, cfg.metrics.port)
            except OSError as exc:  # metrics must never stop training
                log.warning(
                    "metrics: cannot serve on %s:%d (%s); continuing without", cfg.metrics.host, cfg.metrics.port, exc
                )
    ctx = AttemptContext(attempt, rdir, records, watch, metrics, previous_failure, phases)
    try:
        return _run_attempt(cfg, rank, world, ctx)
    except JobStopped:
        raise
    except BaseException as exc:
        for abort in ctx.on_abort:
            try:
                abort()  # e.g. stop a background writer: its step will not be committed
            except Exception as abort_exc:  # the failure itself must still be recorded
                log.warning("rank %d: cleanup after the failure failed: %s", rank, abort_exc)
        info = classify(exc)
        record_failure(rdir, attempt, rank, info)
        if isinstance(exc, PreemptedError):
            raise
        log.error("rank %d failed (%s): %s", rank, info.classification, info.exception)
        # A rank 0 that only saw a peer vanish leaves the diagnosis to the next attempt.
        records.end("failed", None, None if info.peer_lost else info)
        if confirmed_deterministic(info, previous_failure):
            reason = f"the same {info.classification} error ended two attempts in a row: {info.exception}"
            log.error("not retrying: %s", reason)
            write_stop(rdir, reason, rank=rank)
            stop_local_launcher()
            raise JobStopped(reason) from exc
        raise
    finally:
        watch.uninstall()
        if server is not None:
            server.close()


def _run_attempt(cfg: Config, rank: int, world: int, ctx: AttemptContext) -> RunSummary:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tiering.errors import PublishError

    attempts, watch, metrics = ctx.records, ctx.watch, ctx.metrics
    session = build_session(cfg, rank, world, ctx.id, ctx.phases)
    monitor = session.monitor
    monitor.leaving = lambda: watch.requested
    for tier in session.ckpt.background_tiers():
        ctx.on_abort.append(tier.abandon_async)
    restored = restore_latest(session)
    attempts.restored(
        restored.tier if restored else None,
        restored.step if restored else None,
        round(restored.seconds, 4) if restored else None,
    )
    if restored is not None:
        metrics.loaded(restored.tier, restored.seconds)
        maybe_poison_restored(cfg, restored.step, session.state.model)
    if ctx.phases is not None:
        ctx.phases.enter("first_steps", restored=restored.step if restored else None)
    if monitor.load_state_dict(session.state.extra.get("ft", {})):
        session.runlog.event("ft_timeouts", source="checkpoint", timeouts=session.state.extra["ft"])
    monitor.end("setup")
    metrics.tokens_per_step = cfg.data.global_batch_size * cfg.model.seq_length
    metrics.planned_interval_steps = session.ckpt.planned_intervals()
    state, ddp, runlog = session.state, session.ddp, session.runlog
    optimizer, scheduler, sampler = state.optimizer, state.scheduler, state.sampler
    audit = DataAudit(cfg, rank) if cfg.data.audit else None
    forward_backward = get_forward_backward_func()
    seq, mbs, gbs = cfg.model.seq_length, cfg.data.micro_batch_size, cfg.data.global_batch_size
    first_step = state.step + 1
    t_start = time.perf_counter()
    t_window, window_steps = t_start, 0
    for step in range(first_step, cfg.train.steps + 1):
        monitor.start("step")
        node = session.ckpt.local.node if session.ckpt.local is not None else None
        maybe_inject_fault(cfg, rank, step, runlog.event, node=node)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        microbatches = sampler.microbatches(session.dataset, state.consumed_samples)
        if audit is not None:
            audit.record(step, sampler, state.consumed_samples)
        losses = forward_backward(
            forward_step_func=_forward_step,
            data_iterator=iter(microbatches),
            model=[ddp],
            num_microbatches=len(microbatches),
            seq_length=seq,
            micro_batch_size=mbs,
            forward_only=False,
        )
        session.ckpt.before_optimizer_step()  # a background snapshot still copying must finish
        grad_norm = optimizer.step()
        scheduler.step(increment=1)
        state.step = step
        state.consumed_samples += gbs
        state.consumed_tokens += gbs * seq
        loss, leave = _reduce_step(losses, watch.requested)
        lr = optimizer.param_groups[0]["lr"]
        runlog.metrics(step=step, loss=loss, grad_norm=grad_norm, lr=lr, consumed_samples=state.consumed_samples)
        monitor.end("step")
        monitor.beat()
        metrics.stepped(step)
        measured = monitor.maybe_calculate_timeouts(step - first_step + 1)
        if measured is not None:
            state.extra["ft"] = measured  # saved with every checkpoint from now on
            runlog.event("ft_timeouts", source="measured", timeouts=measured)
        if cfg.fault_tolerance.check_finite and not (math.isfinite(loss) and math.isfinite(grad_norm)):
            _non_finite(session, restored, step, loss, grad_norm)
        if step == first_step:
            if ctx.phases is not None:
                ctx.phases.enter("training", first_step=step)
            attempts.first_step(step)
            metrics.recovered(attempts.record.get("lost_steps"), attempts.record.get("rto_seconds"))
        window_steps += 1
        if step % cfg.train.log_interval == 0 and rank == 0:
            now = time.perf_counter()
            tok_s = window_steps * gbs * seq / max(now - t_window, 1e-9)
            log.info("step %d | loss %.6f | grad norm %.4f | lr %.3e | %.0f tokens/s", step, loss, grad_norm, lr, tok_s)
            t_window, window_steps = now, 0
        saved_local = False
        due = session.ckpt.due(step)
        if due:
            monitor.start("checkpointing")
            maybe_slow_save(cfg, step)
        for tier in due:
            if cfg.checkpoint.async_.enabled:
                _start_background_save(session, ctx, tier)
                continue
            try:
                _report_saved(session, ctx, session.ckpt.save(tier, state))
                saved_local = saved_local or tier is session.ckpt.local
            except PublishError as exc:
                _report_failed(session, ctx, tier.name, step, exc)
            monitor.beat()
        # Leaving on a signal: tier 1 must be durable now; promotion staging is not waited for.
        done = _poll_background(session, ctx, block=leave, tiers=[session.ckpt.local] if leave else None)
        saved_local = saved_local or any(d.tier == "local" and d.step == step for d in done)
        monitor.end("checkpointing")
        if leave:
            _leave_on_preemption(session, attempts, watch, saved_local)
    # The final step's tier-1 save must be durable (and replicated) before the attempt counts
    # as finished.
    _poll_background(session, ctx, block=True)
    elapsed = time.perf_counter() - t_start
    done = state.step - first_step + 1
    runlog.event("finish", step=state.step, steps=done, seconds=elapsed)
    attempts.end("succeeded", state.step)
    monitor.close()
    return RunSummary(
        session.attempt,
        first_step,
        state.step,
        restored.step if restored else None,
        restored.seconds if restored else 0.0,
        done / elapsed if elapsed > 0 and done > 0 else 0.0,
    )


def _report_saved(session: Session, ctx: AttemptContext, saved: Any) -> None:
    session.ckpt.committed(saved.step)
    ctx.metrics.saved(saved.tier, saved.seconds)
    session.runlog.event(
        "save",
        tier=saved.tier,
        step=saved.step,
        seconds=saved.seconds,
        blocked_seconds=saved.blocked_seconds,
        bytes=saved.bytes,
        replication_seconds=saved.replication_seconds,
        under_replicated=saved.under_replicated,
    )
    ctx.records.progress(session.state.step, **{f"last_saved_{saved.tier}": saved.step})
    if session.rank == 0:
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


def _report_failed(session: Session, ctx: AttemptContext, tier: str, step: int, exc: Exception) -> None:
    """The step is not published in this tier; older steps are intact. Training goes on (the next
    interval tries again) unless checkpoint.on_save_error is stop."""
    log.error("checkpoint of step %d failed: %s", step, exc)
    session.runlog.event("save_failed", tier=tier, step=step, error=str(exc))
    ctx.metrics.save_failed(tier)
    if session.cfg.checkpoint.on_save_error == "stop":
        raise exc


def _start_background_save(session: Session, ctx: AttemptContext, tier: Any) -> None:
    from tiering.errors import PublishError

    step = session.state.step
    final = step == session.cfg.train.steps  # the last step is never skipped
    if tier.busy():
        if session.cfg.checkpoint.async_.when_busy == "skip" and not final:
            log.warning("%s save of step %d skipped: step %d is still being written", tier.name, step, tier.in_flight)
            session.runlog.event("save_skipped", tier=tier.name, step=step, in_flight=tier.in_flight)
            ctx.metrics.save_skipped(tier.name)
            return
        _poll_background(session, ctx, block=True, tiers=[tier])
    try:
        tier.start_async(session.state)
    except PublishError as exc:  # refused up front on every rank (a full volume): nothing started
        _report_failed(session, ctx, tier.name, step, exc)
        return
    ctx.metrics.queue_depth = ctx.metrics.uncommitted = session.ckpt.in_flight_count()


def _poll_background(session: Session, ctx: AttemptContext, block: bool, tiers: list[Any] | None = None) -> list[Any]:
    """Collective while a save is in flight: publish each tier's save when every writer is done.
    Returns the saves published now (a failed one is reported and training goes on)."""
    from tiering.errors import PublishError

    published = []
    for tier in tiers if tiers is not None else session.ckpt.background_tiers():
        if tier is None or tier.in_flight is None:
            continue
        step = tier.in_flight
        try:
            saved = tier.poll_async(block)
        except PublishError as exc:
            ctx.metrics.queue_depth = ctx.metrics.uncommitted = session.ckpt.in_flight_count()
            _report_failed(session, ctx, tier.name, step, exc)
            continue
        if saved is not None:
            ctx.metrics.queue_depth = ctx.metrics.uncommitted = session.ckpt.in_flight_count()
            _report_saved(session, ctx, saved)
            published.append(saved)
    return published


def _non_finite(session: Session, restored: Any, step: int, loss: float, grad_norm: float) -> None:
    """Fail the step; a NaN/Inf soon after a restore marks the restored step as poisoned."""
    what, value = ("loss", loss) if not math.isfinite(loss) else ("grad norm", grad_norm)
    window = session.cfg.fault_tolerance.poison_window
    if restored is not None and step - restored.step <= window:
        reason = (
            f"{what} became {value} at step {step}, {step - restored.step} steps after restoring step "
            f"{restored.step} from tier {restored.tier} (fault_tolerance.poison_window={window}): suspect checkpoint"
        )
        moved = session.ckpt.quarantine_everywhere(restored.step, reason)
        session.runlog.event("poisoned_checkpoint", step=restored.step, tier=restored.tier, at_step=step, moved=moved)
        if session.rank == 0:
            log.error("quarantined step %d everywhere (%s); the next restore uses an older step", restored.step, reason)
    raise NonFiniteError(step, what, value)


def _leave_on_preemption(session: Session, attempts: AttemptLog, watch: PreemptionWatch, saved_local: bool) -> None:
    """Collective (every rank agreed at this step boundary): emergency tier-1 save, then exit."""
    from tiering.errors import PublishError

    step = session.state.step
    local = session.ckpt.local
    published = saved_local
    if local is None:
        outcome = "tier 1 is disabled: no emergency save"
    elif saved_local:
        outcome = f"step {step} was just saved in tier 1"
    else:
        session.monitor.start("checkpointing")
        if session.phases is not None:
            session.phases.enter("emergency_save", step=step)
        try:
            saved = local.save(session.state, deadline=watch.deadline)
            published = True
            outcome = f"emergency save of step {step} published in {saved.seconds:.2f}s"
        except PublishError as exc:
            outcome = f"emergency save of step {step} not published ({exc})"
    watch.finished()
    if session.rank == 0:
        log.warning("%s received: %s; exiting %d", watch.signal_name, outcome, PreemptedError.EXIT_CODE)
    session.runlog.event("preempted", signal=watch.signal_name, step=step, published=published, outcome=outcome)
    attempts.end("preempted", step, signal=watch.signal_name, emergency=outcome, emergency_published=published)
    session.monitor.close()
    raise PreemptedError(f"{watch.signal_name}: {outcome}")


class DataAudit:
    """Optional per-rank record of the samples each step consumed (``data.audit: true``)."""

    def __init__(self, cfg: Config, rank: int) -> None:
        self.path = Path(cfg.run.dir) / cfg.run.id / "data-audit" / f"rank-{rank:05d}.jsonl"

    def record(self, step: int, sampler: Any, consumed: int) -> None:
        positions = list(sampler.global_positions(consumed))
        append_jsonl(
            self.path,
            {
                "step": step,
                "dp_rank": sampler.dp_rank,
                "dp_size": sampler.dp_size,
                "positions": positions,
                "indices": [sampler.dataset_index(p) for p in positions],
            },
        )


def _forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_masked_mean_loss, batch["loss_mask"])


def _masked_mean_loss(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    losses = output.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    loss = (losses * mask).sum() / mask.sum().clamp(min=1.0)
    # clone: the schedule divides the returned loss in place by the number of micro-batches
    return loss, {"lm loss": loss.detach().clone()}


def _reduce_step(losses: list[dict[str, torch.Tensor]], leave: bool) -> tuple[float, bool]:
    """Mean micro-batch loss over the world (only last-stage ranks contribute), and whether any
    rank was asked to leave: one all-reduce, so every rank agrees on the step to stop at."""
    total = torch.zeros(3, dtype=torch.float64)
    for item in losses or []:
        total[0] += float(item["lm loss"])
        total[1] += 1
    total[2] = 1.0 if leave else 0.0
    dist.all_reduce(total)
    loss = float(total[0] / total[1]) if total[1] > 0 else float("nan")
    return loss, bool(total[2] > 0)

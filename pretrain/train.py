"""The rank program: Megatron Core GPT pretraining with verified checkpoints and exact resume.

:func:`train` validates the config, creates the process group (or hands over to NVRx's
in-process restart), and runs one attempt inside :mod:`pretrain.resilience.attempt_guard`'s frame.
The loop itself only trains: it asks the checkpoint manager to restore once, tells it about every
step (``before_optimizer_step``, ``after_step``) and calls ``finish`` at the end; which tier saves
when, in the foreground or the background, and what is reported, is the manager's business.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from pretrain.checkpointing.agent.client import AgentLink, introduce_nodes, keep_agent_watching
from pretrain.checkpointing.manager import CheckpointManager
from pretrain.checkpointing.memory_budget import host_memory_per_node, host_memory_refusal, node_memory_bytes
from pretrain.checkpointing.reporting import SaveReport
from pretrain.checkpointing.reshardable import wait_for_writer_warmup
from pretrain.checkpointing.run_key_source import key_path, load_run_key
from pretrain.checkpointing.state import RestoreResult
from pretrain.commands.plan_model import host_layout, model_size
from pretrain.config import Config, validate
from pretrain.errors import AgentGone, ConfigError, JobStopped, NonFiniteError, StragglerExcluded
from pretrain.evaluation import Evaluator
from pretrain.forward import forward_step, reduce_losses
from pretrain.observability.runlog import append_jsonl, run_dir
from pretrain.observability.tensorboard_log import TensorBoardLog
from pretrain.platform import cpu_shims
from pretrain.platform.device_memory import TorchDeviceMemory, wait_for_device_memory
from pretrain.platform.rank_device import select_rank_device
from pretrain.resilience.attempt_guard import AttemptContext, close_attempt, fail_attempt, open_attempt
from pretrain.resilience.excluded_nodes import exclude, path_of
from pretrain.resilience.faults import maybe_inject_fault, maybe_poison_restored, phase_hold
from pretrain.resilience.hang_watch import AUTO, RankLimit
from pretrain.resilience.inprocess import run_inprocess
from pretrain.resilience.phases import PhaseRecord
from pretrain.resilience.stragglers import FORWARD, STEP, StragglerWatch, sink_to
from pretrain.session import Session, build_session, control_collective
from tiering.collective import TorchCollective
from tiering.errors import RunKeyError
from tiering.peer.placement import node_name

log = logging.getLogger("pretrain")
_AGENT_WATCH: AgentLink | None = None  # the connection that keeps the node's agent (and its hang watch) up


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


def _check_host_memory(cfg: Config, world: int, cuda: bool) -> None:
    """Refuse a node with less memory than the run's tiers need per node (``pretrain plan`` prints it)."""
    layout = host_layout(cfg, model_size(cfg, world), _env_int("LOCAL_WORLD_SIZE", 1), gpu=cuda)
    have = node_memory_bytes()
    refusal = host_memory_refusal(str(cfg.source), host_memory_per_node(layout), have) if have else None
    if refusal:
        raise ConfigError(refusal)


GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"


def gloo_lazy_init(environ: dict[str, str] | os._Environ[str], cuda: bool, inprocess: bool) -> bool:
    """Whether the world-size gloo groups beside NCCL (control plane, replication, tier 0's peer
    stream) connect pairs at first use: set on CUDA, where each rank talks to a few peers and a full
    mesh costs ~4,000 sockets a rank at 2,000 ranks ("Too many open files"); torch >= 2.7 reads it.
    Not with NVRx's in-process restart: its abort and re-creation of groups with lazy gloo
    connections aborted gloo in 2 of 7 measured runs (issue 45 #13). A launcher's value is kept,
    with a warning where it asks for lazy connections under in-process restart."""
    if cuda and not inprocess:
        environ.setdefault(GLOO_LAZY_INIT, "1")
    lazy = environ.get(GLOO_LAZY_INIT, "0") not in ("", "0")
    if lazy and inprocess:
        log.warning(
            "%s=%s set by the launcher with in-process restart on (gloo aborted in 2 of 7 such runs); "
            "fix: unset it, or set fault_tolerance.inprocess.enabled: false",
            GLOO_LAZY_INIT, environ[GLOO_LAZY_INIT],
        )  # fmt: skip
    return lazy


def train(cfg: Config) -> RunSummary:
    """Run (or resume) training to ``train.steps``. Must run under torchrun/ft_launcher (or 1 rank)."""
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    setup_logging(rank)
    cuda = torch.cuda.is_available()
    validate(cfg, world, cuda)  # before any process group exists
    _check_host_memory(cfg, world, cuda)
    cpu_shims.install()
    phases = PhaseRecord(run_dir(cfg.run.dir, cfg.run.id), rank, on_enter=phase_hold(cfg.fault_tolerance.inject))
    phases.mark_signals_until_replaced()
    phases.start_pulse()  # signs of life for the next attempt's diagnosis (a hang, a fatal signal)
    global _AGENT_WATCH  # noqa: PLW0603 - one connection for the process's life, in-process restarts included
    # the node's agent reads the pulse from outside (auto: once this rank's limit is measured, see TrainingLoop)
    fixed = 0.0 if cfg.fault_tolerance.hang_watch_s == AUTO else cfg.fault_tolerance.hang_watch_s
    _AGENT_WATCH = _AGENT_WATCH or keep_agent_watching(cfg.run, cfg.checkpoint, fixed)
    phases.enter("startup")
    device = select_rank_device()  # before NCCL, in-process restarts included (their Wrapper runs in this thread)
    gloo_lazy_init(os.environ, cuda, cfg.fault_tolerance.inprocess.enabled)
    if device is not None:  # a dead rank (held by the kernel) or its writer may still hold this GPU
        reclaim = wait_for_device_memory(TorchDeviceMemory(device), cfg.fault_tolerance.gpu_memory_reclaim_timeout)
        if not reclaim.freed or reclaim.waited_s > 1.0:
            log.warning("rank %d: %s", rank, reclaim.line())
    if cfg.fault_tolerance.inprocess.enabled:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29555")
        summary = run_inprocess(
            cfg, lambda: _train_in_group(cfg, _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), phases)
        )
        _release_agent()
        return summary
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # a plain single-process run
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29555")
        phases.enter("rendezvous")
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10))
    try:
        summary = _train_in_group(cfg, rank, world, phases)
    finally:
        wait_for_writer_warmup()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    _release_agent()
    return summary


def _auto_hang_limit(cfg: Config, cuda: bool, loaded: Any) -> RankLimit | None:
    """This rank's side of ``hang_watch_s: auto`` (pretrain.resilience.hang_watch); None where it is
    off: set otherwise, or a tier-1 writer thread on the training process (a save that holds the
    GIL would stop the pulse: GPU, or in-process restarts keeping the writer's copy)."""
    ft = cfg.fault_tolerance
    if ft.hang_watch_s != AUTO:
        return None
    mode = cfg.checkpoint.async_.mode
    # Tier 0 auto may turn itself off at start, and then tier 1 keeps the in-process copy: count it so.
    keeps_copy = ft.inprocess.enabled and ft.inprocess.keep_host_copy and cfg.checkpoint.memory.enabled is not True
    if mode == "thread" or (mode == "auto" and (cuda or keeps_copy)):
        log.info("hang watch auto: off (a tier-1 writer thread in the rank); fix: set fault_tolerance.hang_watch_s")
        return None
    return RankLimit(ft.calculate_timeouts_after, float(loaded) if loaded else None)


def _watch_this_rank(cfg: Config) -> None:
    """``auto``: this rank's limit is known: make sure the node's agent watches the run."""
    global _AGENT_WATCH  # noqa: PLW0603 - one connection for the process's life
    _AGENT_WATCH = _AGENT_WATCH or keep_agent_watching(cfg.run, cfg.checkpoint, AUTO)


def _watch_peer_nodes(session: Session, ctx: AttemptContext) -> None:
    """Collective. A multi-node run: from here on this node's agent beats to the other nodes'
    agents and finds a lost node in ``fault_tolerance.node_lost_s`` (start-up and the restore are
    left to NVRx's timeouts); see :mod:`pretrain.resilience.node_liveness`."""
    cfg, ft = session.cfg, session.cfg.fault_tolerance
    if ft.node_lost_s <= 0 or session.world <= _env_int("LOCAL_WORLD_SIZE", session.world):
        return
    global _AGENT_WATCH  # noqa: PLW0603 - one connection for the process's life
    _AGENT_WATCH = _AGENT_WATCH or keep_agent_watching(cfg.run, cfg.checkpoint, ft.hang_watch_s, always=True)
    coll = session.tiers.coll
    link = _AGENT_WATCH
    try:
        load_run_key(cfg.checkpoint.integrity, cfg.run, coll)  # made here when no tier made it
    except RunKeyError as exc:  # on this rank only, maybe (a file system that hides rank 0's new file)
        log.warning("lost nodes are found by NVRx's timeouts only: %s", exc)
        link = None  # this rank still takes part in the gather below, as every rank must
    key_file, _ = key_path(cfg.checkpoint.integrity, cfg.run)
    node = node_name(cfg.checkpoint.replication.node)
    introduce_nodes(link, coll, node, ctx.id, key_file, ft.node_lost_s)


def _release_agent() -> None:
    """The run trained to its end on this rank: the node's agent may exit once every rank left."""
    if _AGENT_WATCH is not None:
        with contextlib.suppress(AgentGone):
            _AGENT_WATCH.request({"op": "finish"})
        _AGENT_WATCH.close()


def _train_in_group(cfg: Config, rank: int, world: int, phases: PhaseRecord | None = None) -> RunSummary:
    """One attempt inside its frame: opened, run, and on any exception reported and closed."""
    ctx = open_attempt(cfg.run, cfg.fault_tolerance, cfg.metrics, rank, world, control_collective(), phases)
    try:
        return _run_attempt(cfg, rank, world, ctx)
    except JobStopped:
        raise
    except BaseException as exc:
        fail_attempt(ctx, exc)
        raise
    finally:
        close_attempt(ctx)


def _restore(session: Session, ctx: AttemptContext, checkpointer: CheckpointManager) -> RestoreResult | None:
    """Restore, record it, and load the measured rank-monitor timeouts the checkpoint carried."""
    restored = checkpointer.restore()
    ctx.records.restored(
        restored.tier if restored else None,
        restored.step if restored else None,
        round(restored.seconds, 4) if restored else None,
    )
    if restored is not None:
        ctx.metrics.loaded(restored.tier, restored.seconds)
        maybe_poison_restored(session.cfg.fault_tolerance.inject, restored.step, session.state.model)
    if ctx.phases is not None:
        ctx.phases.enter("first_steps", restored=restored.step if restored else None)
    if session.monitor.load_state_dict(session.state.extra.get("ft", {})):
        session.runlog.event("ft_timeouts", source="checkpoint", timeouts=session.state.extra["ft"])
    session.monitor.end("setup")
    return restored


def _run_attempt(cfg: Config, rank: int, world: int, ctx: AttemptContext) -> RunSummary:
    session = build_session(cfg, rank, world, ctx.id, ctx.phases)
    session.monitor.leaving = lambda: ctx.watch.requested
    report = SaveReport(
        session.tiers, session.runlog, ctx.metrics, ctx.records, rank, cfg.checkpoint.on_save_error == "stop"
    )
    checkpointer = CheckpointManager(
        cfg, session.tiers, session.state, report, session.monitor, ctx.watch, ctx.phases, session.sync_weights
    )
    ctx.on_abort.append(checkpointer.abandon)
    restored = _restore(session, ctx, checkpointer)
    _watch_peer_nodes(session, ctx)
    ctx.metrics.tokens_per_step = cfg.data.global_batch_size * cfg.model.seq_length
    ctx.metrics.planned_interval_steps = session.tiers.planned_intervals()
    loop = TrainingLoop(session, ctx, checkpointer, restored)
    first_step = session.state.step + 1
    t_start = time.perf_counter()
    try:
        for step in range(first_step, cfg.train.steps + 1):
            leave = loop.step(step, first=step == first_step)
            checkpointer.after_step(step, leaving=leave)  # raises PreemptedError when leaving
            if loop.stragglers.excluded is not None:
                checkpointer.finish()  # the saves due at this step (and any in flight) are published first
                raise StragglerExcluded(loop.stragglers.excluded, step, str(path_of(ctx.run_dir)))
            loop.maybe_evaluate(step)
        checkpointer.finish()
    finally:
        loop.tensorboard.close()
        loop.stragglers.close()
    elapsed = time.perf_counter() - t_start
    done = session.state.step - first_step + 1
    session.runlog.event("finish", step=session.state.step, steps=done, seconds=elapsed)
    ctx.records.end("succeeded", session.state.step)
    session.monitor.close()
    return RunSummary(
        session.attempt,
        first_step,
        session.state.step,
        restored.step if restored else None,
        restored.seconds if restored else 0.0,
        done / elapsed if elapsed > 0 and done > 0 else 0.0,
    )


class TrainingLoop:
    """One training step at a time: forward/backward over the step's micro-batches, the optimizer
    step, the step's metrics, heartbeats and the non-finite check."""

    def __init__(
        self, session: Session, ctx: AttemptContext, checkpointer: CheckpointManager, restored: RestoreResult | None
    ) -> None:
        self.session = session
        self.ctx = ctx
        self.checkpointer = checkpointer
        self.restored = restored
        self.cfg = session.cfg
        self.audit = DataAudit(self.cfg, session.rank) if self.cfg.data.audit else None
        node = session.tiers.local.node if session.tiers.local is not None else socket.gethostname()
        sink = sink_to(ctx.metrics, session.runlog.event)

        def exclude_node(name: str, **evidence: Any) -> str:
            return str(exclude(ctx.run_dir, name, attempt=ctx.id, **evidence))

        straggler = self.cfg.fault_tolerance.straggler
        broadcast = TorchCollective().broadcast
        self.stragglers = StragglerWatch(straggler, session.rank, node, sink, exclude_node, broadcast)
        self.forward_backward = self.stragglers.wrap(get_forward_backward_func(), STEP)
        self.forward_step = self.stragglers.wrap(forward_step, FORWARD)
        self.first_step = session.state.step + 1
        self.window = (time.perf_counter(), 0)  # (start time, steps) of the throughput window
        self.step_started = time.perf_counter()
        self.hang_limit = _auto_hang_limit(self.cfg, torch.cuda.is_available(), session.state.extra.get("hang_watch_s"))
        self.tensorboard = TensorBoardLog(self.cfg.logging.tensorboard_dir, enabled=session.rank == 0)
        dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        valid = session.valid
        self.evaluator = Evaluator(self.cfg, valid, session.ddp, dp_rank, dp_size) if valid is not None else None

    def maybe_evaluate(self, step: int) -> None:
        """Collective: validation loss when ``eval.interval`` says so, to every log."""
        if self.evaluator is None or not self.evaluator.due(step):
            return
        loss = self.evaluator.loss()
        ppl = math.exp(loss) if loss < 700 else float("inf")
        s = self.session
        s.runlog.metrics(kind="validation", step=step, loss=loss, perplexity=ppl, iters=self.cfg.eval.iters)
        self.ctx.metrics.validated(step, loss)
        self.tensorboard.validation(step, loss)
        if s.rank == 0:
            log.info("step %d | validation loss %.6f | perplexity %.3f", step, loss, ppl)

    def step(self, step: int, first: bool) -> bool:
        """Train ``step``; returns whether every rank agreed to leave (a preemption signal)."""
        s, cfg = self.session, self.cfg
        state, monitor = s.state, s.monitor
        self.step_started = time.perf_counter()
        if self.hang_limit is not None and (limit := self.hang_limit.step_started(self.step_started)) is not None:
            self._watched(limit)
        monitor.start("step")
        node = s.tiers.local.node if s.tiers.local is not None else None
        maybe_inject_fault(cfg.fault_tolerance.inject, s.rank, step, s.runlog.event, node=node)
        s.ddp.zero_grad_buffer()
        state.optimizer.zero_grad()
        microbatches = state.sampler.microbatches(s.dataset, state.consumed_samples)
        if self.audit is not None:
            self.audit.record(step, state.sampler, state.consumed_samples)
        losses = self.forward_backward(
            forward_step_func=self.forward_step,
            data_iterator=iter(microbatches),
            model=[s.ddp],
            num_microbatches=len(microbatches),
            seq_length=cfg.model.seq_length,
            micro_batch_size=cfg.data.micro_batch_size,
            forward_only=False,
        )
        self.checkpointer.before_optimizer_step()  # a background snapshot still copying must finish
        grad_norm = state.optimizer.step()
        state.scheduler.step(increment=1)
        state.step = step
        state.consumed_samples += cfg.data.global_batch_size
        state.consumed_tokens += cfg.data.global_batch_size * cfg.model.seq_length
        loss, leave = reduce_losses(losses, self.ctx.watch.requested)
        self.stragglers.after_step(step)  # a collective every report_interval steps
        self._after(step, first, loss, grad_norm)
        return leave

    def _watched(self, limit: float) -> None:
        """``hang_watch_s: auto``: this rank's limit is known (measured, or loaded from the checkpoint):
        its phase record carries it for the node's agent, which watches from now on."""
        s, ctx = self.session, self.ctx
        source = "checkpoint" if s.state.extra.get("hang_watch_s") == limit else "measured"
        s.state.extra["hang_watch_s"] = limit  # saved with every checkpoint from now on
        if ctx.phases is not None:
            ctx.phases.keep(hang_watch_s=limit)
        s.runlog.event("hang_watch", limit_s=limit, source=source)  # a kill of it: hang_killed (the diagnosis reads it)
        _watch_this_rank(self.cfg)

    def _after(self, step: int, first: bool, loss: float, grad_norm: float) -> None:
        s, ctx, cfg = self.session, self.ctx, self.cfg
        lr = s.state.optimizer.param_groups[0]["lr"]
        s.runlog.metrics(step=step, loss=loss, grad_norm=grad_norm, lr=lr, consumed_samples=s.state.consumed_samples)
        s.monitor.beat()  # the step section stays open: the checkpoint manager's after_step ends it
        ctx.metrics.stepped(step)
        measured = s.monitor.maybe_calculate_timeouts(step - self.first_step + 1)
        if measured is not None:
            s.state.extra["ft"] = measured  # saved with every checkpoint from now on
            s.runlog.event("ft_timeouts", source="measured", timeouts=measured)
            ctx.records.note(hang_timeout_s=s.monitor.hang_timeout_s())
        if cfg.fault_tolerance.check_finite and not (math.isfinite(loss) and math.isfinite(grad_norm)):
            _non_finite(s, self.restored, step, loss, grad_norm)
        if first:
            if ctx.phases is not None:
                ctx.phases.enter("training", first_step=step)
            ctx.records.note(hang_timeout_s=s.monitor.hang_timeout_s())  # loaded from the checkpoint or configured
            ctx.records.first_step(step)
            ctx.metrics.recovered(ctx.records.record.get("lost_steps"), ctx.records.record.get("rto_seconds"))
        tok_s = cfg.data.global_batch_size * cfg.model.seq_length / max(time.perf_counter() - self.step_started, 1e-9)
        self.tensorboard.step(step, loss, lr, grad_norm, tok_s)
        self._log(step, loss, grad_norm, lr)

    def _log(self, step: int, loss: float, grad_norm: float, lr: float) -> None:
        started, steps = self.window
        steps += 1
        self.window = (started, steps)
        if step % self.cfg.train.log_interval == 0 and self.session.rank == 0:
            now = time.perf_counter()
            tok_s = steps * self.cfg.data.global_batch_size * self.cfg.model.seq_length / max(now - started, 1e-9)
            log.info("step %d | loss %.6f | grad norm %.4f | lr %.3e | %.0f tokens/s", step, loss, grad_norm, lr, tok_s)
            self.window = (now, 0)


def _non_finite(session: Session, restored: RestoreResult | None, step: int, loss: float, grad_norm: float) -> None:
    """Fail the step; a NaN/Inf soon after a restore marks the restored step as poisoned."""
    what, value = ("loss", loss) if not math.isfinite(loss) else ("grad norm", grad_norm)
    window = session.cfg.fault_tolerance.poison_window
    if restored is not None and step - restored.step <= window:
        reason = (
            f"{what} became {value} at step {step}, {step - restored.step} steps after restoring step "
            f"{restored.step} from tier {restored.tier} (fault_tolerance.poison_window={window}): suspect checkpoint"
        )
        moved = session.tiers.quarantine_everywhere(restored.step, reason)
        session.runlog.event("poisoned_checkpoint", step=restored.step, tier=restored.tier, at_step=step, moved=moved)
        if session.rank == 0:
            log.error("quarantined step %d everywhere (%s); the next restore uses an older step", restored.step, reason)
    raise NonFiniteError(step, what, value)


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

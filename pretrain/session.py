"""What one attempt (or in-process incarnation) of the rank program builds before its first step:
Megatron's parallel state, the data, the model wrapped in Megatron DDP, the optimizer and LR
schedule, the complete training state, the checkpoint tiers and the run's event log. Nothing is
restored here (:meth:`pretrain.checkpointing.manager.CheckpointManager.restore` does that).
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn
from torch.utils.data import Dataset

from pretrain.checkpointing.state import TrainingState
from pretrain.checkpointing.tiered import TieredCheckpointer
from pretrain.config import Config, ParallelConfig, data_parallel_size, padded_vocab_size, resolve_vocab_size
from pretrain.data.dataset import build_datasets, snapshot_id
from pretrain.data.sampler import GlobalBatchSampler
from pretrain.model import build_model, resolve_spec_name, transformer_config
from pretrain.observability.runlog import RunLog
from pretrain.optim import build_optimizer, build_scheduler, uses_distributed_optimizer
from pretrain.rank_state import seed_everything
from pretrain.resilience.phases import PhaseRecord
from pretrain.resilience.rank_monitor import RankMonitor
from pretrain.resilience.restarts import incarnation, launcher_restart_count
from tiering.collective import TorchCollective

log = logging.getLogger("pretrain")


@dataclass
class Session:
    cfg: Config
    rank: int
    world: int
    attempt: str
    ddp: DistributedDataParallel
    dataset: Dataset  # the train split (one dataset or a blend)
    valid: Dataset | None  # the valid split, when data.split gives it a weight
    state: TrainingState
    tiers: TieredCheckpointer
    runlog: RunLog
    monitor: RankMonitor
    phases: PhaseRecord | None = None
    sync_weights: Callable[[], None] | None = None  # see weight_sync: before any tier snapshots the weights


# Control-plane collectives (attempt ids, save statuses, restore agreement, the agreement after
# each rank fetched its share of an S3 step) may wait as long as a restore's slowest part: NVRx's
# setup section (30 min in configs/ft-h100.yaml), not NCCL's 10 min.
CONTROL_TIMEOUT = datetime.timedelta(minutes=30)


def control_collective() -> TorchCollective:
    """Collective. The control plane's collectives on gloo: on a NCCL default group each
    ``all_gather_object`` is two NCCL all-gathers plus device-to-host syncs, and a wait for the
    slowest rank's share of an S3 download would meet the NCCL watchdog at 10 min. On CPU the
    default group is gloo already."""
    if dist.get_backend() == "gloo":
        return TorchCollective()
    return TorchCollective(dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT))


def _init_model_parallel(cfg: Config) -> None:
    if parallel_state.model_parallel_is_initialized():
        return
    ipc = cfg.fault_tolerance.inprocess
    # In-process restarts: Megatron's groups get the incarnation's timeout for the backend (a
    # backstop: the restart's abort fails collectives in flight at once; NCCL's outlasts hard_timeout).
    timeout_min = ipc.group_timeout(torch.cuda.is_available()) / 60.0 if ipc.enabled else 30
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.parallel.tp,
        pipeline_model_parallel_size=cfg.parallel.pp,
        distributed_timeout_minutes=timeout_min,
    )


def ddp_config(parallel: ParallelConfig, cuda: bool) -> DistributedDataParallelConfig:
    """On CUDA the gradient reduce-scatter overlaps the backward in buckets (Megatron's default
    bucket: max(40M, 1M x DP) elements) and, with the distributed optimizer, the parameter
    all-gather overlaps the next forward (its pre-hooks gather each bucket as it is needed; a tier
    snapshots the weights only after :func:`weight_sync` made them current); on CPU one bucket
    after the backward and the gather inside the optimizer step (the bit-exact tests' order)."""
    distributed = uses_distributed_optimizer(parallel)
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=cuda,
        overlap_param_gather=cuda and distributed,  # Megatron: only with the distributed optimizer
        use_distributed_optimizer=distributed,
    )


def weight_sync(ddp: DistributedDataParallel) -> Callable[[], None] | None:
    """What makes the model's weights current before a tier snapshots them (issue 45 #16). With the
    parameter all-gather overlapped, the optimizer step updates each rank's shard only and the next
    forward's pre-hooks gather the rest: a snapshot then would hold stale weights but the local
    shard. This forces that gather now, synchronously (as Megatron's trainer does before its saves,
    ``disable_forward_pre_hook``); the next forward finds it done and gathers nothing again. None
    without the overlap: the optimizer step gathered already."""
    if not ddp.ddp_config.overlap_param_gather:
        return None
    return functools.partial(ddp.start_param_sync, force_sync=True)


def _wrap_ddp(parallel: ParallelConfig, tconfig: TransformerConfig, model: nn.Module) -> DistributedDataParallel:
    config = ddp_config(parallel, torch.cuda.is_available())
    ddp = DistributedDataParallel(tconfig, config, model)
    tconfig.finalize_model_grads_func = finalize_model_grads
    tconfig.no_sync_func = ddp.no_sync
    if config.overlap_grad_reduce:  # as Megatron's trainer: the last micro-batch starts each bucket's reduce
        tconfig.grad_sync_func = ddp.start_grad_sync
    return ddp


def _training_state(
    cfg: Config, world: int, model: nn.Module, ddp: DistributedDataParallel, samples: int
) -> TrainingState:
    dp = data_parallel_size(cfg, world)
    topology = {"tp": cfg.parallel.tp, "pp": cfg.parallel.pp, "dp": dp, "world_size": world}
    optimizer = build_optimizer(cfg.optimizer, cfg.parallel, cfg.model.precision, ddp)
    scheduler = build_scheduler(cfg.schedule, cfg.optimizer, cfg.train.steps, optimizer)
    sampler = GlobalBatchSampler(
        samples,
        cfg.data.global_batch_size,
        cfg.data.micro_batch_size,
        parallel_state.get_data_parallel_rank(),
        dp,
        cfg.train.seed,
    )
    return TrainingState(cfg, model, optimizer, scheduler, sampler, topology, snapshot_id(cfg.data))


def build_session(cfg: Config, rank: int, world: int, attempt: str, phases: PhaseRecord | None = None) -> Session:
    """Collective. The rank monitor connects first: the ``setup`` section covers the rest and the restore.
    (A reshardable tier that not every rank sees is refused by the tier's ``prepare``, once its
    storage answered a probe: a check here would block on stalled shared storage.)"""
    monitor = RankMonitor(cfg.fault_tolerance)
    monitor.start("setup")  # ends once the restore is done
    if phases is not None:
        phases.enter("monitor", monitor=monitor.active, monitor_wedged=monitor.wedged)
    _init_model_parallel(cfg)
    coll = control_collective()
    runlog = RunLog(cfg.run.dir, cfg.run.id, attempt, enabled=rank == 0)
    seed_everything(cfg.train.seed + 100 * parallel_state.get_pipeline_model_parallel_rank())
    dataset, valid = build_datasets(
        cfg.data, cfg.train.seed, cfg.model.seq_length, functools.partial(resolve_vocab_size, cfg)
    )
    tconfig = transformer_config(cfg.model, cfg.parallel)
    model = build_model(cfg.model, padded_vocab_size(cfg), tconfig)
    ddp = _wrap_ddp(cfg.parallel, tconfig, model)
    state = _training_state(cfg, world, model, ddp, len(dataset))
    if rank == 0:
        log.info(
            "model: %s spec, %d params on rank 0, topology %s, %d samples/epoch",
            resolve_spec_name(cfg.model),
            sum(t.numel() for t in model.parameters()),
            state.topology,
            len(dataset),
        )
    runlog.event(
        "start",
        rank_count=world,
        incarnation=incarnation(),
        pids=coll.all_gather(os.getpid()),
        topology=state.topology,
        launcher_restart_count=launcher_restart_count(),
        host=os.uname().nodename,
    )
    if monitor.wedged:
        runlog.event("rank_monitor_wedged", force=True, rank=rank, host=os.uname().nodename)
    tiers = TieredCheckpointer(cfg, coll, attempt, state.topology, record_event=runlog.event, phases=phases)
    return Session(
        cfg, rank, world, attempt, ddp, dataset, valid, state, tiers, runlog, monitor, phases, weight_sync(ddp)
    )

"""Optimizers, LR schedule and TP-correct gradient clipping.

On CUDA: Megatron's DistributedOptimizer (``get_megatron_optimizer``), whose checkpoint sharding
type is chosen per checkpoint kind. On CPU: torch AdamW over Megatron DDP's ``main_grad`` buffers,
with its state mapped to the model's ShardedTensors so that it is fully reshardable.

Three gaps in Megatron's DistributedOptimizer (megatron-core 0.16.1 and core_r0.19.0) are closed
here, around its calls, never by changing Megatron:

* its dp-reshardable parameter state (tier-1 saves) is written without the ``padding`` flag its
  own loader filters on (0.19 ``distrib_optimizer.py`` L1227-1260 against L2082; 0.16.1 L942-973
  against L1793): saves write the flag, loads default it so that steps already written load;
* without TE or Apex its ``load_state_dict`` gives every parameter one shared Adam ``step`` tensor
  (0.19 L1024-1032, 0.16.1 L818-825), which torch's AdamW then bumps once per parameter: every
  load ends by giving each parameter its own (:func:`give_each_param_its_own_step`);
* its ``state_dict()`` asserts on an unstepped optimizer without TE or Apex (0.19 L836-840), and
  ``sharded_state_dict`` calls it first even when loading: before a load the state is allocated
  the way its own ``load_state_dict`` allocates it.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.optimizer import distrib_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from pretrain.config import OptimizerConfig, ParallelConfig, ScheduleConfig
from pretrain.platform.compat import MEM_EFFICIENT_KEY, fully_reshardable_mem_efficient


class TrainOptimizer(Protocol):
    param_groups: list[dict[str, Any]]

    def zero_grad(self) -> None: ...

    def step(self) -> float:
        """Apply one update; return the global (pre-clip) gradient norm."""
        ...

    def sharded_state_dict(self, model_sharded_state_dict: dict, kind: str, is_loading: bool = False) -> dict:
        """The checkpoint layout of the state; ``is_loading``: a template to load into (the
        optimizer may allocate its state for it), as Megatron's own loader asks for it."""
        ...

    def load_sharded_state_dict(self, state: dict) -> None: ...

    def local_state_dict(self) -> dict:
        """This rank's optimizer state as it lives here (fast local saves; same topology to load)."""
        ...

    def load_local_state_dict(self, state: dict) -> None: ...


def _no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    return param.dim() == 1 or name.endswith(".bias")


class CpuAdamW:
    """torch AdamW over DDP ``main_grad`` with TP/PP-aware global-norm clipping."""

    def __init__(self, o: OptimizerConfig, model: torch.nn.Module) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        decay = [p for n, p in named if not _no_weight_decay(n, p)]
        no_decay = [p for n, p in named if _no_weight_decay(n, p)]
        self.params = decay + no_decay  # the optimizer's own order: the state-id mapping relies on it
        self.opt = torch.optim.AdamW(
            [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}],
            lr=o.lr,
            betas=(o.adam_beta1, o.adam_beta2),
            eps=o.adam_eps,
            weight_decay=o.weight_decay,
        )
        self.clip_grad = o.clip_grad
        self._init_state()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.opt.param_groups

    def _init_state(self) -> None:
        """Materialise Adam state so that a checkpoint template exists before the first step."""
        for p in self.params:
            state = self.opt.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> float:
        for p in self.params:
            p.grad = p.main_grad if p.main_grad.dtype == p.dtype else p.main_grad.to(p.dtype)
        norm = global_grad_norm(self.params)
        if self.clip_grad > 0 and math.isfinite(norm) and norm > self.clip_grad:
            scale = self.clip_grad / (norm + 1.0e-6)
            for p in self.params:
                p.grad.mul_(scale)
        self.opt.step()
        return norm

    def sharded_state_dict(self, model_sharded_state_dict: dict, kind: str, is_loading: bool = False) -> dict:
        # The torch-optimizer layout is the same for every checkpoint kind: always reshardable;
        # its state exists from construction (_init_state), so a load template needs nothing more.
        state = self.opt.state_dict()
        steps = {float(s["step"]) for s in state["state"].values()}
        if len(steps) != 1:
            raise RuntimeError(f"optimizer steps differ per parameter: {sorted(steps)}")
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.params)
        optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
        state["state"]["common_step"] = steps.pop()
        return state

    def load_sharded_state_dict(self, state: dict) -> None:
        common_step = state["state"].pop("common_step")
        for param_state in state["state"].values():
            param_state["step"] = torch.tensor(float(common_step))
        state["param_groups"] = self.opt.state_dict()["param_groups"]
        self.opt.load_state_dict(state)

    def local_state_dict(self) -> dict:
        return self.opt.state_dict()

    def load_local_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state)


class MegatronDistributedOptimizer:
    """Megatron's DistributedOptimizer (CUDA): sharded fp32 master weights and Adam state."""

    def __init__(self, o: OptimizerConfig, precision: str, model: torch.nn.Module) -> None:
        """``o``: the optimizer section; ``precision``: model.precision (bf16 keeps fp32 master weights)."""
        from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer

        ocfg = MegatronOptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2,
            adam_eps=o.adam_eps,
            clip_grad=o.clip_grad,
            bf16=precision == "bf16",
            params_dtype=torch.float32,
            use_distributed_optimizer=True,
        )
        self.opt = get_megatron_optimizer(ocfg, [model])

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.opt.param_groups

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self) -> float:
        _ok, grad_norm, _zeros = self.opt.step()
        return float(grad_norm) if grad_norm is not None else float("nan")

    def sharded_state_dict(self, model_sharded_state_dict: dict, kind: str, is_loading: bool = False) -> dict:
        gloo = all(getattr(part, "data_parallel_group_gloo", None) is not None for part in self._parts())
        metadata = sharding_metadata(kind, fully_reshardable_mem_efficient() and gloo)
        if is_loading:
            self._allocate_state_for_load()
        return self.opt.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading, metadata=metadata)

    def load_sharded_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state)
        self._untie_steps()

    def _parts(self) -> list[Any]:
        """The DistributedOptimizers inside: get_megatron_optimizer returns a ChainedOptimizer
        (one part per parameter kind, one here), which has no parameter-state accessors itself."""
        return list(getattr(self.opt, "chained_optimizers", [self.opt]))

    def local_state_dict(self) -> dict:
        # This rank's shard of the fp32 main params and Adam moments, as it lives here (the
        # tensors are the optimizer's own: the writer copies them before the next step).
        param_state = [mark_padding(part.get_parameter_state_dp_reshardable()) for part in self._parts()]
        return {"optimizer": self.opt.state_dict(), "param_state": param_state}

    def load_local_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["optimizer"])
        parts = self._parts()
        if len(parts) != len(state["param_state"]):
            saved = len(state["param_state"])
            raise RuntimeError(f"tier-1 optimizer state has {saved} parts, this optimizer {len(parts)}")
        for part, param_state in zip(parts, state["param_state"]):
            part.load_parameter_state_from_dp_reshardable(mark_padding(param_state))
        self._untie_steps()

    def _untie_steps(self) -> None:
        for part in self._parts():
            give_each_param_its_own_step(part.optimizer)

    def _allocate_state_for_load(self) -> None:
        """Without TE or Apex, Megatron's ``state_dict()`` (which ``sharded_state_dict`` calls
        first) needs every parameter's Adam ``step``: a fresh optimizer has none. Allocate the
        state through Megatron's own ``load_state_dict`` (uninitialised shards on the current
        device, step 0), which the load then overwrites. With TE or Apex the step lives in the
        parameter groups and ``sharded_state_dict(is_loading=True)`` allocates by itself."""
        if distrib_optimizer.HAVE_APEX_OR_TE:
            return
        for part in self._parts():
            if len(part.optimizer.state) == 0:
                part.load_state_dict(step_zero_state_dict(part.optimizer))


def sharding_metadata(kind: str, mem_efficient: bool) -> dict[str, Any]:
    """Megatron's metadata for the optimizer's sharded state. Megatron refuses fully_reshardable
    for non-persistent local saves: tier 1 uses the fast DP-reshardable layout, reshardable
    (durable) saves the fully reshardable one, with the memory-efficient gather where
    ``mem_efficient`` (the installed Megatron offers it and the optimizer has its gloo DP group):
    the fp32 state gathers to DP rank 0 over gloo, not to every DP rank's GPU and host over NCCL
    (~44 GB of host memory per rank at 70B TP8 PP4; issue 45 #4). Loads read either layout."""
    if kind != "reshardable":
        return {"distrib_optim_sharding_type": "dp_reshardable"}
    metadata: dict[str, Any] = {"distrib_optim_sharding_type": "fully_reshardable"}
    if mem_efficient:
        metadata[MEM_EFFICIENT_KEY] = True
    return metadata


def mark_padding(param_state: dict) -> dict:
    """Give every entry of a dp-reshardable parameter state (``get_parameter_state_dp_reshardable``
    layout: ``state[gbuf][dtype][bucket]`` is a list of per-parameter dicts) the ``padding`` flag
    Megatron's loader filters on; False where missing (these entries are parameters: the getter
    writes no padding entries). Changes the dicts in place and returns the state."""
    for key, dtype_state in param_state.items():
        if not isinstance(key, int):  # per_bucket_numel, per_bucket_numel_unpadded
            continue
        for buckets in dtype_state.values():
            for bucket in buckets:
                for entry in bucket:
                    entry.setdefault("padding", False)
    return param_state


def give_each_param_its_own_step(optimizer: torch.optim.Optimizer) -> int:
    """Replace every Adam ``step`` tensor shared with another parameter by a copy of its own
    (torch's AdamW adds 1 to each parameter's step tensor: a shared one would count every
    parameter). Returns how many were replaced."""
    seen: set[int] = set()
    replaced = 0
    for state in optimizer.state.values():
        step = state.get("step")
        if not isinstance(step, torch.Tensor):
            continue
        if step.data_ptr() in seen:
            state["step"] = step.clone()
            replaced += 1
        else:
            seen.add(step.data_ptr())
    return replaced


def step_zero_state_dict(optimizer: torch.optim.Optimizer) -> dict:
    """A DistributedOptimizer ``state_dict()`` as it would read before the first step: the inner
    optimizer's parameter groups (without their parameter indices) at step 0."""
    inner = optimizer.state_dict()
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "step": 0} for g in inner["param_groups"]]
    return {"optimizer": {k: v for k, v in inner.items() if k != "state"} | {"param_groups": groups}}


def uses_distributed_optimizer(parallel: ParallelConfig) -> bool:
    mode = parallel.distributed_optimizer
    return mode == "on" or (mode == "auto" and torch.cuda.is_available())


def build_optimizer(
    optimizer: OptimizerConfig, parallel: ParallelConfig, precision: str, model: torch.nn.Module
) -> TrainOptimizer:
    """``precision``: ``model.precision``."""
    if uses_distributed_optimizer(parallel):
        return MegatronDistributedOptimizer(optimizer, precision, model)
    return CpuAdamW(optimizer, model)


def global_grad_norm(params: list[torch.nn.Parameter]) -> float:
    """L2 norm of all gradients, counting TP-duplicated and PP-shared parameters once."""
    total = torch.zeros(1, dtype=torch.float64, device=params[0].device if params else "cpu")
    for p in params:
        if p.grad is not None and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
            total += p.grad.detach().double().pow(2).sum()
    if parallel_state.get_model_parallel_group() is not None and torch.distributed.is_initialized():
        torch.distributed.all_reduce(total, group=parallel_state.get_model_parallel_group())
    return float(total.sqrt().item())


class _SchedulerTarget:
    """The minimal optimizer view OptimizerParamScheduler needs (its ``param_groups``)."""

    def __init__(self, opt: TrainOptimizer) -> None:
        self._opt = opt

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._opt.param_groups


def build_scheduler(
    schedule: ScheduleConfig, optimizer: OptimizerConfig, train_steps: int, opt: TrainOptimizer
) -> OptimizerParamScheduler:
    """``train_steps``: ``train.steps``, the decay length when ``schedule.decay_steps`` is unset."""
    s, o = schedule, optimizer
    decay_steps = s.decay_steps if s.decay_steps is not None else train_steps
    return OptimizerParamScheduler(
        _SchedulerTarget(opt),  # type: ignore[arg-type]
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=s.warmup_steps,
        lr_decay_steps=max(decay_steps, s.warmup_steps + 1),
        lr_decay_style=s.decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=max(decay_steps, 1),
        wd_incr_style="constant",
    )

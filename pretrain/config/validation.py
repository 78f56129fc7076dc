"""Everything checked before a process group exists: every section's own rules, the topology
rules, and the rules that span sections or depend on the launch (CUDA or not)."""

from __future__ import annotations

from pretrain.config.fail import Fail
from pretrain.config.root import Config
from pretrain.config.topology import (
    check_topology,
)


def validate(cfg: Config, world_size: int, cuda: bool) -> None:
    """Check every section, then the rules across sections and the launch; raise ConfigError naming the key."""
    fail = Fail(cfg.source)
    cfg.check(fail)  # first: the rules below divide by the sizes it checks
    check_topology(cfg, world_size, fail)
    s = cfg.schedule
    decay = s.decay_steps if s.decay_steps is not None else cfg.train.steps
    if decay <= s.warmup_steps and s.decay_style != "constant":
        fail(
            "schedule.decay_steps",
            f"{decay} must exceed schedule.warmup_steps={s.warmup_steps}",
            "raise decay_steps (or train.steps) above the warmup",
        )
    if not cuda:
        _check_cpu_only(cfg, fail)
    # After the CPU rules, so that on CPU the fix named is "set it to false", not "raise tp".
    if cfg.parallel.sequence_parallel and cfg.parallel.tp == 1:
        fail("parallel.sequence_parallel", "needs tp > 1", "enable tensor parallelism or disable it")
    if cfg.checkpoint.async_.mode == "fork" and cuda:
        fail("checkpoint.async.mode", "fork is unsafe in a CUDA process", "use thread (or auto)")
    if cfg.eval.interval and cfg.data.split_weights()[1] == 0:
        fail(
            "data.split",
            f"{cfg.data.split!r} leaves the valid split empty while eval.interval={cfg.eval.interval}",
            "give the valid split a weight (e.g. data.split: 98,2,0) or set eval.interval: 0",
        )
    inj = cfg.fault_tolerance.inject
    if inj.kill_rank >= world_size:
        fail(
            "fault_tolerance.inject.kill_rank",
            f"rank {inj.kill_rank} >= world size {world_size}",
            "pick an existing rank or -1",
        )


def _check_cpu_only(cfg: Config, fail: Fail) -> None:
    """What a launch without CUDA cannot do."""
    m, p = cfg.model, cfg.parallel
    if m.spec == "te":
        fail("model.spec", "Transformer Engine layers need CUDA, none found", "use spec: auto or local on CPU")
    if m.precision == "bf16":
        fail("model.precision", "bf16 training needs CUDA here", "use precision: fp32 on CPU")
    if p.sequence_parallel:
        fail("parallel.sequence_parallel", "needs TE/Apex norms (CUDA)", "set it to false on CPU")
    if p.pp > 1 and not m.untie_embeddings:
        fail(
            "model.untie_embeddings",
            "tied embeddings across pipeline stages need CUDA (Megatron moves them with .cuda())",
            "set model.untie_embeddings: true for pp > 1 on CPU",
        )
    if p.distributed_optimizer == "on":
        fail(
            "parallel.distributed_optimizer",
            "Megatron's DistributedOptimizer is CUDA-only",
            "use auto or off on CPU",
        )

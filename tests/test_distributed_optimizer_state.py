"""The tier-1 save/load of Megatron's DistributedOptimizer state, run through Megatron's own code.

The DistributedOptimizer itself cannot be built on CPU (its constructor and parameter-group
checks hard-code CUDA). Its state bookkeeping can: :class:`RecordedLayout` holds the layout a
one-rank DistributedOptimizer keeps (grad-buffer ranges, parameter-group map, an inner torch
AdamW over fp32 main-parameter shards) and borrows the installed Megatron's own ``state_dict``,
``load_state_dict``, ``get_parameter_state_dp_reshardable`` and
``load_parameter_state_from_dp_reshardable``. What stays GPU-only: the state allocation of a
fresh optimizer (``torch.empty(..., device=torch.cuda.current_device())``), exercised by the GPU
check's restarts (tests/gpu/).
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

from pretrain.optim import (
    MegatronDistributedOptimizer,
    give_each_param_its_own_step,
    mark_padding,
    step_zero_state_dict,
)

SHAPES = [(4, 3), (3,), (5, 2), (7,)]
GROUP_KEYS = {"lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}


class RecordedLayout:
    """A one-rank DistributedOptimizer's layout and inner AdamW, with Megatron's own methods."""

    state_dict = DistributedOptimizer.state_dict
    load_state_dict = DistributedOptimizer.load_state_dict
    get_parameter_state_dp_reshardable = DistributedOptimizer.get_parameter_state_dp_reshardable
    load_parameter_state_from_dp_reshardable = DistributedOptimizer.load_parameter_state_from_dp_reshardable
    _get_main_param_and_optimizer_states = DistributedOptimizer._get_main_param_and_optimizer_states
    _set_main_param_and_optimizer_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.model_params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
        self.main_params = [p.detach().clone().view(-1) for p in self.model_params]
        decay, no_decay = [0, 2], [1, 3]  # weights / biases, as Megatron groups them
        self.optimizer = torch.optim.AdamW(
            [
                {"params": [self.main_params[i] for i in decay], "wd_mult": 1.0, **GROUP_KEYS},
                {"params": [self.main_params[i] for i in no_decay], "wd_mult": 0.0, **GROUP_KEYS},
            ],
            lr=1e-2,
            weight_decay=0.1,
            foreach=True,  # what runs on CUDA: one _foreach_add_ over every parameter's step
        )
        self.model_param_group_index_map = {}
        for group_index, members in enumerate((decay, no_decay)):
            for order, i in enumerate(members):
                self.model_param_group_index_map[self.model_params[i]] = (group_index, order)
        param_map, offset = {}, 0
        for p in self.model_params:  # one bucket; DP=1: the local range is the whole parameter
            n = p.numel()
            param_map[p] = {"gbuf_local": Range(offset, offset + n), "gbuf_world": Range(offset, offset + n)}
            offset += n
        self.gbuf_ranges = [{torch.float32: [{"param_map": param_map}]}]
        self.per_bucket_numel = self.per_bucket_numel_unpadded = {0: {torch.float32: [offset]}}
        self.config = types.SimpleNamespace(
            use_precision_aware_optimizer_no_fp8_or_ds_fp8=False,
            fp16=False,
            exp_avg_dtype=torch.float32,
            exp_avg_sq_dtype=torch.float32,
        )
        self.ddp_config = types.SimpleNamespace(use_megatron_fsdp=False)
        self.grad_scaler = None

    def adam_step(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for p in self.main_params:
            p.grad = torch.randn(p.shape, generator=gen)
        self.optimizer.step()

    def wrapped(self) -> MegatronDistributedOptimizer:
        """The project's optimizer wrapper around this layout (a ChainedOptimizer of one part
        is the part itself for everything the wrapper calls)."""
        opt = MegatronDistributedOptimizer.__new__(MegatronDistributedOptimizer)
        opt.opt = self
        return opt


def _saved_and_restored(tmp_path: Path, old_format: bool = False) -> tuple[RecordedLayout, RecordedLayout]:
    """A layout trained 3 steps and saved to a real file (tier-1 payload), and a fresh one
    (allocated state, as after Megatron's first allocation) that loaded it."""
    saver = RecordedLayout(seed=1)
    for i in range(3):
        saver.adam_step(seed=10 + i)
    payload = saver.wrapped().local_state_dict()
    if old_format:  # what the code before the fix wrote: no padding flags
        for entry in payload["param_state"][0][0][torch.float32][0]:
            entry.pop("padding")
    torch.save(payload, tmp_path / "state.pt")
    loader = RecordedLayout(seed=2)
    loader.adam_step(seed=99)  # state allocated; its values are overwritten by the load
    loader.wrapped().load_local_state_dict(torch.load(tmp_path / "state.pt", weights_only=False))
    return saver, loader


def _assert_same_state(a: RecordedLayout, b: RecordedLayout) -> None:
    for pa, pb in zip(a.main_params, b.main_params):
        assert torch.equal(pa, pb)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a.optimizer.state[pa][key], b.optimizer.state[pb][key]), key


def test_megatron_dp_reshardable_loader_needs_the_padding_flag_its_getter_omits() -> None:
    layout = RecordedLayout(seed=1)
    layout.adam_step(seed=3)
    with pytest.raises(KeyError, match="padding"):
        layout.load_parameter_state_from_dp_reshardable(layout.get_parameter_state_dp_reshardable())
    layout.load_parameter_state_from_dp_reshardable(mark_padding(layout.get_parameter_state_dp_reshardable()))


def test_tier1_distributed_optimizer_state_round_trips_through_a_file(tmp_path: Path) -> None:
    saver, loader = _saved_and_restored(tmp_path)
    _assert_same_state(saver, loader)
    saved = torch.load(tmp_path / "state.pt", weights_only=False)["param_state"][0][0][torch.float32][0]
    assert [entry["padding"] for entry in saved] == [False] * len(SHAPES)


def test_tier1_step_written_without_padding_flags_still_loads(tmp_path: Path) -> None:
    saver, loader = _saved_and_restored(tmp_path, old_format=True)
    _assert_same_state(saver, loader)


def test_each_parameter_has_its_own_adam_step_after_a_load_and_training_continues_exactly(tmp_path: Path) -> None:
    saver, loader = _saved_and_restored(tmp_path)
    steps = [loader.optimizer.state[p]["step"] for p in loader.main_params]
    assert len({s.data_ptr() for s in steps}) == len(steps)
    for i in range(2):  # the restored optimizer continues exactly as the uninterrupted one
        saver.adam_step(seed=50 + i)
        loader.adam_step(seed=50 + i)
    _assert_same_state(saver, loader)
    assert [float(loader.optimizer.state[p]["step"]) for p in loader.main_params] == [5.0] * len(SHAPES)


def test_megatron_load_without_the_fix_shares_one_step_that_counts_every_parameter() -> None:
    """The defect the fix removes, shown on Megatron's own load_state_dict (no TE/Apex)."""
    saver = RecordedLayout(seed=1)
    saver.adam_step(seed=10)
    loader = RecordedLayout(seed=2)
    loader.adam_step(seed=99)
    loader.load_state_dict(saver.state_dict())
    steps = {loader.optimizer.state[p]["step"].data_ptr() for p in loader.main_params}
    assert len(steps) == 1
    loader.adam_step(seed=5)
    assert float(loader.optimizer.state[loader.main_params[0]]["step"]) == 1 + len(SHAPES)
    assert give_each_param_its_own_step(loader.optimizer) == len(SHAPES) - 1
    assert len({loader.optimizer.state[p]["step"].data_ptr() for p in loader.main_params}) == len(SHAPES)


def test_the_state_allocated_before_a_reshardable_load_reads_as_megatron_writes_it_at_step_0() -> None:
    """What the wrapper hands Megatron's load_state_dict to allocate a fresh optimizer's state
    (without TE/Apex, before sharded_state_dict(is_loading=True)): Megatron's own state_dict()
    of the same optimizer, with the step at 0."""
    layout = RecordedLayout(seed=1)
    layout.adam_step(seed=3)
    ours = step_zero_state_dict(layout.optimizer)
    theirs = layout.state_dict()
    assert [g["step"] for g in theirs["optimizer"]["param_groups"]] == [1.0, 1.0]
    for group in theirs["optimizer"]["param_groups"]:
        group["step"] = 0
    assert ours == theirs

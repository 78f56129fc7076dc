"""Megatron's performance switches per device (issue 45 #16): fused kernels and the overlapped,
bucketed gradient reduce-scatter and (with the distributed optimizer) the parameter all-gather
on CUDA, forced before a tier snapshots the weights; the reference paths and one bucket on CPU, where the
bit-exact resume tests run (tests/test_resume_exact.py covers that nothing changed there)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from megatron.core.distributed import DistributedDataParallel

from pretrain.config import load_config
from pretrain.model import fusions, transformer_config
from pretrain.session import ddp_config, weight_sync
from tests.helpers import TINY


def test_cpu_keeps_every_fusion_off() -> None:
    assert not any(fusions(cuda=False, te=False).values())
    assert not any(fusions(cuda=False, te=True).values())
    tc = transformer_config(load_config(TINY).model, load_config(TINY).parallel)
    assert not (tc.bias_activation_fusion or tc.gradient_accumulation_fusion or tc.apply_rope_fusion)


@pytest.mark.parametrize("te", [True, False])
def test_cuda_turns_on_what_its_spec_can_run(te: bool) -> None:
    on = fusions(cuda=True, te=te)
    assert on["bias_activation_fusion"] and on["bias_dropout_fusion"]
    # wgrad accumulation into main_grad, fused RoPE and the masked softmax need TE (Apex is not installed)
    assert on["gradient_accumulation_fusion"] == on["apply_rope_fusion"] == on["masked_softmax_fusion"] == te
    assert not on["persist_layer_norm"]


def test_the_gradient_reduce_overlaps_in_buckets_on_cuda_and_the_param_gather_with_the_distributed_optimizer() -> None:
    parallel = load_config(TINY).parallel
    distributed = dataclasses.replace(parallel, distributed_optimizer="on")
    cpu, cuda = ddp_config(parallel, cuda=False), ddp_config(distributed, cuda=True)
    assert not cpu.overlap_grad_reduce and cuda.overlap_grad_reduce
    assert cuda.bucket_size is None  # Megatron's default bucket when overlapping: max(40M, 1M x DP) elements
    # Issue 45 #16: the gather overlaps the next forward on CUDA (Megatron allows it with the
    # distributed optimizer only); a tier snapshots the weights after weight_sync forced it.
    assert cuda.overlap_param_gather and cuda.use_distributed_optimizer
    assert not cpu.overlap_param_gather
    assert not ddp_config(dataclasses.replace(parallel, distributed_optimizer="off"), cuda=True).overlap_param_gather
    assert not ddp_config(distributed, cuda=False).overlap_param_gather  # CPU: the bit-exact tests' order
    assert cpu.grad_reduce_in_fp32 and cuda.grad_reduce_in_fp32


class _GatherLog:
    """Megatron DDP's param-sync entry as the weight sync calls it (DDP with the distributed
    optimizer cannot be built on CPU); records each call's keywords."""

    def __init__(self, config: object) -> None:
        self.ddp_config = config
        self.calls: list[dict] = []

    def start_param_sync(self, *unused: object, force_sync: bool = False, force_dispatch: bool = False) -> None:
        self.calls.append({"force_sync": force_sync, "force_dispatch": force_dispatch})


def test_the_weight_sync_forces_the_pending_gather_only_where_it_overlaps() -> None:
    parallel = dataclasses.replace(load_config(TINY).parallel, distributed_optimizer="on")
    overlapped = _GatherLog(ddp_config(parallel, cuda=True))
    sync = weight_sync(overlapped)  # type: ignore[arg-type]
    assert sync is not None
    sync()
    assert overlapped.calls == [{"force_sync": True, "force_dispatch": False}]
    assert weight_sync(_GatherLog(ddp_config(parallel, cuda=False))) is None  # type: ignore[arg-type]
    assert inspect.signature(DistributedDataParallel.start_param_sync).parameters["force_sync"].default is False

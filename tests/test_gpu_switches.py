"""Megatron's performance switches per device (issue 45 #16): fused kernels and the overlapped,
bucketed gradient reduce-scatter on CUDA; the reference paths and one bucket on CPU, where the
bit-exact resume tests run (tests/test_resume_exact.py covers that nothing changed there)."""

from __future__ import annotations

import pytest

from pretrain.config import load_config
from pretrain.model import fusions, transformer_config
from pretrain.session import ddp_config
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


def test_the_gradient_reduce_overlaps_in_buckets_on_cuda_only_and_the_param_gather_never() -> None:
    parallel = load_config(TINY).parallel
    cpu, cuda = ddp_config(parallel, cuda=False), ddp_config(parallel, cuda=True)
    assert not cpu.overlap_grad_reduce and cuda.overlap_grad_reduce
    assert cuda.bucket_size is None  # Megatron's default bucket when overlapping: max(40M, 1M x DP) elements
    assert not cpu.overlap_param_gather and not cuda.overlap_param_gather  # the snapshot reads the param buffer
    assert cpu.grad_reduce_in_fp32 and cuda.grad_reduce_in_fp32

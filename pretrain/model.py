"""Megatron Core GPT model construction: Transformer Engine spec on GPU, local spec on CPU."""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from pretrain.config import ModelConfig, ParallelConfig


class SDPACoreAttention(MegatronModule):
    """Core attention through ``torch.nn.functional.scaled_dot_product_attention``.

    Replaces Megatron's ``DotProductAttention`` on CPU hosts: that module takes its score buffer
    from a CUDA global memory buffer and its dropout RNG from the CUDA RNG tracker. Inputs and
    output follow Megatron's layout: ``[seq, batch, heads_per_partition, head_dim]`` in and
    ``[seq, batch, heads_per_partition * head_dim]`` out. Masking is causal; attention dropout
    draws from the default (CPU) generator, whose state the checkpoint saves per rank.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        **_unused: Any,
    ) -> None:
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"SDPACoreAttention supports causal masks only, got {attn_mask_type}")
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(
        self,
        query,
        key,
        value,
        attention_mask=None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **_extra,  # megatron-core 0.19 passes core_attention_extra_kwargs (see pretrain/platform/compat.py)
    ):  # noqa: ANN001 - Megatron's call signature
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("packed sequences and attention bias need the TE spec")
        groups = query.size(2) // key.size(2)
        if groups > 1:  # grouped-query attention: repeat K/V heads to match the query heads
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout_p if self.training else 0.0, scale=self.softmax_scale
        )
        s, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def transformer_engine_usable() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def resolve_spec_name(model: ModelConfig) -> str:
    if model.spec == "auto":
        return "te" if transformer_engine_usable() else "local"
    return model.spec


def fusions(cuda: bool, te: bool) -> dict[str, bool]:
    """Megatron's fused kernels: off on CPU (CUDA-only; the reference paths there), on with CUDA.
    Some need Transformer Engine (or Apex, not installed): the wgrad accumulation into main_grad,
    the fused RoPE and the masked softmax (the local spec's attention is SDPA, no softmax to fuse).
    ``persist_layer_norm`` needs Apex's persistent LayerNorm; TE has its own norms."""
    return {
        "bias_activation_fusion": cuda,
        "bias_dropout_fusion": cuda,
        "masked_softmax_fusion": cuda and te,
        "apply_rope_fusion": cuda and te,
        "gradient_accumulation_fusion": cuda and te,
        "persist_layer_norm": False,
    }


def transformer_config(m: ModelConfig, p: ParallelConfig) -> TransformerConfig:
    bf16 = m.precision == "bf16"
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        normalization=m.normalization,
        gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu,
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        sequence_parallel=p.sequence_parallel,
        use_cpu_initialization=not torch.cuda.is_available(),
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        # Shapes are static per run; the schedules need them for p2p communication.
        variable_seq_lengths=False,
        **fusions(torch.cuda.is_available(), resolve_spec_name(m) == "te"),
        batch_p2p_comm=torch.cuda.is_available(),
        batch_p2p_sync=torch.cuda.is_available(),
    )


def layer_spec(model: ModelConfig):
    if resolve_spec_name(model) == "te":
        return get_gpt_layer_with_transformer_engine_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False)
    spec = get_gpt_layer_local_spec(num_experts=None, moe_grouped_gemm=False, normalization=model.normalization)
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def build_model(model_cfg: ModelConfig, padded_vocab: int, tconfig: TransformerConfig) -> GPTModel:
    """One GPTModel chunk for this rank's pipeline stage (no virtual pipeline); ``padded_vocab``:
    :func:`pretrain.config.padded_vocab_size` of the run's config."""
    model = GPTModel(
        config=tconfig,
        transformer_layer_spec=layer_spec(model_cfg),
        vocab_size=padded_vocab,
        max_sequence_length=model_cfg.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not model_cfg.untie_embeddings,
        position_embedding_type=model_cfg.position_embedding,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model

"""Schema of ``model`` and ``parallel``: the GPT's shape and how it is split (TP, PP, the optimizer).

Each section checks only its own fields; rules that need the world size live in :mod:`.topology`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pretrain.config.fail import Fail, positive


@dataclass
class ModelConfig:
    num_layers: int = 2  # transformer layers
    hidden_size: int = 128  # model width
    num_attention_heads: int = 4  # must divide hidden_size
    num_query_groups: int | None = None  # grouped-query attention groups (None: one per head)
    ffn_hidden_size: int | None = None  # MLP width (None: Megatron's default, 4 x hidden_size)
    seq_length: int = 128  # tokens per sample
    # None: the tokenizer's vocabulary (byte: 257); a set value must not be smaller than it.
    vocab_size: int | None = None
    make_vocab_size_divisible_by: int = 128  # the vocabulary is padded up to a multiple of this
    hidden_dropout: float = 0.1  # dropout probability after attention and MLP
    attention_dropout: float = 0.1  # dropout probability of the attention weights
    position_embedding: Literal["rope", "learned_absolute"] = "rope"  # rotary or learned absolute positions
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"  # layer norm kind
    swiglu: bool = False  # SwiGLU MLP instead of GeLU
    untie_embeddings: bool = False  # a separate output layer instead of the input embedding's weights
    init_method_std: float = 0.02  # standard deviation of the weight initialisation
    # auto: Transformer Engine layers when TE and CUDA are present, else Megatron's local spec.
    spec: Literal["auto", "local", "te"] = "auto"
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16 needs CUDA

    def check(self, fail: Fail) -> None:
        positive(
            fail,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            seq_length=self.seq_length,
            make_vocab_size_divisible_by=self.make_vocab_size_divisible_by,
        )
        if self.vocab_size is not None:
            positive(fail, vocab_size=self.vocab_size)
        if self.hidden_size % self.num_attention_heads:
            fail(
                "num_attention_heads",
                f"{self.num_attention_heads} does not divide model.hidden_size={self.hidden_size}",
                "pick heads that divide the hidden size",
            )
        for key, value in (("hidden_dropout", self.hidden_dropout), ("attention_dropout", self.attention_dropout)):
            if not 0.0 <= value < 1.0:
                fail(key, f"{value} is outside [0, 1)", "use a probability")


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size
    sequence_parallel: bool = False  # Megatron sequence parallelism (with tp > 1)
    # auto: Megatron's DistributedOptimizer on CUDA, a torch AdamW over DDP main_grad on CPU.
    distributed_optimizer: Literal["auto", "on", "off"] = "auto"

    def check(self, fail: Fail) -> None:
        positive(fail, tp=self.tp, pp=self.pp)

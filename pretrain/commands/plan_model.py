"""The parameter count and each rank's checkpoint state bytes, derived from a config's model section.

Counts what :func:`pretrain.model.build_model` builds (Megatron's GPTModel; the local and TE
specs hold the same parameters): per layer, the attention's fused QKV projection (grouped-query
attention: ``h x (h + 2 x groups x h / heads)``) and output projection, the MLP's two projections
(SwiGLU doubles the first), two norms (LayerNorm: weight and bias; RMSNorm: weight), and every
linear layer's bias (Megatron's default ``add_bias_linear``, which the project keeps); the word
embeddings (the padded vocabulary), learned position embeddings when configured, the final norm
and an untied output layer. With 12 x L x h^2 + 13 x L x h + (V + s) x h + 2h for a plain GPT
(MHA, MLP 4h, LayerNorm, learned positions, tied embeddings): Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC'21), section 5.1.

A rank holds one tensor-parallel shard of one pipeline stage: column-parallel weights and biases
and the embeddings are split over TP, norms and row-parallel biases are not; the heaviest stage
(the first holds the embeddings, the last the final norm and the output layer, or with tied
embeddings and PP > 1 its copy of them) sizes every rank. State per rank: weights in the model's
precision, plus Adam's two moments and (bf16) an fp32 master copy, divided over the data-parallel
ranks by Megatron's distributed optimizer.

Never: imports torch or Megatron (``pretrain plan`` must answer at once) or reads a checkpoint.
Called by :mod:`pretrain.commands.plan_command`; checked against the built model by tests/test_plan.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.checkpointing.memory_budget import Layout
from pretrain.config import Config, ModelConfig, padded_vocab_size

WEIGHT_BYTES = {"fp32": 4, "bf16": 2}
# Per parameter beyond the weights: Adam's m and v (fp32), and an fp32 master copy for bf16 weights.
OPTIMIZER_BYTES = {"fp32": 8, "bf16": 12}


@dataclass(frozen=True)
class LayerParams:
    """One transformer layer's parameters: split over TP, and held whole by every TP rank."""

    sharded: int
    replicated: int


@dataclass(frozen=True)
class ModelSize:
    """What ``pretrain plan --config`` says about the model and one rank's state."""

    params: int  # the whole model (tied embeddings counted once)
    params_per_rank: int  # the heaviest pipeline stage's tensor-parallel shard
    tp: int
    pp: int
    dp: int
    distributed_optimizer: bool
    weight_bytes: int  # per parameter, before the division by dp (each DP rank saves a slice: dp_slices)
    optimizer_bytes: int  # per parameter, before the distributed optimizer's division by dp
    state_bytes_per_rank: int

    def arena_bytes(self) -> tuple[int, ...]:
        """A rank's state by dtype, as the snapshot arenas hold it (one arena per dtype): the
        weights' slice and the optimizer state (fp32), one arena when the weights are fp32 too."""
        weights = -(-self.params_per_rank * self.weight_bytes // self.dp)
        optimizer = self.state_bytes_per_rank - weights
        return (weights + optimizer,) if self.weight_bytes == 4 else (weights, optimizer)

    def describe(self) -> str:
        opt = f"{self.optimizer_bytes} B / dp {self.dp}" if self.distributed_optimizer else f"{self.optimizer_bytes} B"
        weights = f"{self.weight_bytes} B / dp {self.dp}" if self.dp > 1 else f"{self.weight_bytes} B"
        layout = f"tp {self.tp} x pp {self.pp} x dp {self.dp}"
        layout += ", distributed optimizer" if self.distributed_optimizer else ""
        return f"{count(self.params_per_rank)} params per rank x ({weights} weights + {opt} optimizer) ({layout})"


def vocab_for_plan(cfg: Config) -> int:
    """The padded vocabulary: ``model.vocab_size`` when set (the tokenizer file need not exist on the
    planning machine), else the tokenizer's (reads it, as training does)."""
    if cfg.model.vocab_size is not None:
        multiple = cfg.model.make_vocab_size_divisible_by
        return -(-cfg.model.vocab_size // multiple) * multiple
    return padded_vocab_size(cfg)


def layer_params(m: ModelConfig, tp: int) -> LayerParams:
    h = m.hidden_size
    kv = (m.num_query_groups or m.num_attention_heads) * (h // m.num_attention_heads)
    ffn = m.ffn_hidden_size or 4 * h
    gate = 2 if m.swiglu else 1
    norm = 2 * h if m.normalization == "LayerNorm" else h
    qkv = h * (h + 2 * kv) + (h + 2 * kv)  # column parallel, weight and bias
    proj = h * h  # row parallel weight (its bias is replicated)
    fc1 = h * ffn * gate + ffn * gate  # column parallel
    fc2 = ffn * h  # row parallel
    return LayerParams(sharded=(qkv + proj + fc1 + fc2) // tp, replicated=2 * norm + h + h)


def count_params(m: ModelConfig, vocab: int) -> int:
    """The whole model's parameters (TP 1, PP 1)."""
    layer = layer_params(m, 1)
    h = m.hidden_size
    final_norm = 2 * h if m.normalization == "LayerNorm" else h
    positions = m.seq_length * h if m.position_embedding == "learned_absolute" else 0
    output = vocab * h if m.untie_embeddings else 0
    return m.num_layers * (layer.sharded + layer.replicated) + vocab * h + positions + final_norm + output


def params_per_rank(m: ModelConfig, vocab: int, tp: int, pp: int) -> int:
    """The heaviest pipeline stage's share on one tensor-parallel rank."""
    layer = layer_params(m, tp)
    h = m.hidden_size
    layers = m.num_layers // pp * (layer.sharded + layer.replicated)
    embedding = vocab * h // tp + (m.seq_length * h if m.position_embedding == "learned_absolute" else 0)
    final_norm = 2 * h if m.normalization == "LayerNorm" else h
    # The last stage's output layer: its own weights when untied; with PP > 1 a tied copy too.
    output = vocab * h // tp if (m.untie_embeddings or pp > 1) else 0
    if pp == 1:
        return layers + embedding + final_norm + output
    return max(layers + embedding, layers + final_norm + output)


def uses_distributed_optimizer(cfg: Config) -> bool:
    """``on``; ``auto`` counts as on for bf16 (which needs CUDA, where auto picks it), off for fp32
    (the CPU case: a torch AdamW on every rank)."""
    mode = cfg.parallel.distributed_optimizer
    return mode == "on" or (mode == "auto" and cfg.model.precision == "bf16")


def model_size(cfg: Config, world_size: int) -> ModelSize:
    """Parameters and per-rank state bytes of ``cfg``'s model on ``world_size`` ranks."""
    m, tp, pp = cfg.model, cfg.parallel.tp, cfg.parallel.pp
    vocab = vocab_for_plan(cfg)
    dp = max(1, world_size // (tp * pp))
    per_rank = params_per_rank(m, vocab, tp, pp)
    dist = uses_distributed_optimizer(cfg)
    weight, opt = WEIGHT_BYTES[m.precision], OPTIMIZER_BYTES[m.precision]
    # What a rank's checkpoint holds: its slice of the DP-replicated weights (each DP rank saves
    # 1/dp of them, pretrain.checkpointing.dp_slices) and its optimizer state (1/dp of it with the
    # distributed optimizer).
    state = -(-per_rank * weight // dp) + -(-per_rank * opt // (dp if dist else 1))
    return ModelSize(count_params(m, vocab), per_rank, tp, pp, dp, dist, weight, opt, state)


def count(n: float) -> str:
    """A parameter count as people say it: 8.03 B, 445.95 K."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(int(n))


def host_layout(cfg: Config, size: ModelSize, ranks_per_node: int, gpu: bool) -> Layout:
    """The host-memory figures of ``cfg``'s tiers on nodes of ``ranks_per_node`` ranks."""
    ck = cfg.checkpoint
    return Layout(
        params_per_rank=size.params_per_rank,
        weight_bytes=size.weight_bytes,
        state_bytes_per_rank=size.state_bytes_per_rank,
        ranks_per_node=ranks_per_node,
        tier0_slots=ck.memory.slots if ck.memory.enabled else 0,
        peer_copies=max(0, ck.replication.factor - 1),
        tier1_background=ck.local.enabled and ck.async_.enabled,
        reshardable_gather=ck.reshardable.enabled and size.distributed_optimizer,
        gpu=gpu,
        arena_bytes=size.arena_bytes(),
    )

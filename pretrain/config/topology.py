"""The rules that depend on the world size: TP x PP x DP, heads, layers, the padded vocabulary and
the global batch. ``pretrain launch`` asks :func:`check_world_size` before any node starts, and
judges only these rules: any other problem (a missing tokenizer file) is raised as itself;
:func:`check_room_to_exclude` asks the same of the node count a straggler's exclusion leaves."""

from __future__ import annotations

from pretrain.config.fail import Fail
from pretrain.config.root import Config
from pretrain.data.tokenizer_files import tokenizer_vocab_size
from pretrain.errors import ConfigError


def fitting_node_counts(cfg: Config, nproc_per_node: int, up_to: int) -> list[int]:
    """Node counts from 1 to ``up_to`` whose world size (nodes x ``nproc_per_node``) the parallel
    layout and the global batch divide (what :func:`validate` checks per world size)."""
    vocab = padded_vocab_size(cfg)  # outside the loop: a tokenizer problem is not a node count's
    fits = []
    for nodes in range(1, up_to + 1):
        try:
            check_topology(cfg, nodes * nproc_per_node, Fail(cfg.source), vocab)
        except ConfigError:
            continue
        fits.append(nodes)
    return fits


def check_world_size(cfg: Config, nnodes: int, nproc_per_node: int) -> None:
    """Before any node starts (``pretrain launch``): refuse a node count the layout cannot divide,
    e.g. a scale-down to 5 of 6 nodes, with one line naming the node counts that work. Only the
    topology rules are judged here: any other problem (a missing tokenizer file, say) is raised
    as itself, never dressed up as a node count that does not fit."""
    vocab = padded_vocab_size(cfg)
    try:
        check_topology(cfg, nnodes * nproc_per_node, Fail(cfg.source), vocab)
    except ConfigError as exc:
        problem = str(exc).split("; fix:", 1)[0]
        fits = fitting_node_counts(cfg, nproc_per_node, max(8, 2 * nnodes))
        sizes = ", ".join(f"{n} ({n * nproc_per_node} ranks)" for n in fits) or "none up to " + str(2 * nnodes)
        raise ConfigError(
            f"{nnodes} node(s) x {nproc_per_node} rank(s) = world size {nnodes * nproc_per_node} does not fit "
            f"this layout: {problem}; fix: launch with a node count that fits: {sizes}"
        ) from exc


def check_room_to_exclude(cfg: Config, nnodes: int, nproc_per_node: int) -> None:
    """``fault_tolerance.straggler.action: restart_without`` restarts the job on one node fewer:
    refuse at start when ``nnodes - 1`` nodes cannot hold the layout, naming the counts that can."""
    straggler = cfg.fault_tolerance.straggler
    # One node is never excluded (nothing would remain to restart on): nothing to check.
    if not straggler.enabled or straggler.action != "restart_without" or nnodes <= 1:
        return
    vocab = padded_vocab_size(cfg)
    try:
        check_topology(cfg, (nnodes - 1) * nproc_per_node, Fail(cfg.source), vocab)
        return
    except ConfigError as exc:
        problem = str(exc).split("; fix:", 1)[0].split(": ", 1)[-1]
    fits = [n + 1 for n in fitting_node_counts(cfg, nproc_per_node, max(8, 2 * nnodes))]
    Fail(cfg.source)(
        "fault_tolerance.straggler.action",
        f"restart_without on {nnodes} node(s) x {nproc_per_node} rank(s) would restart on {nnodes - 1}, "
        f"which cannot hold this layout ({problem})",
        "use action: report, or launch on a node count that still fits with one node fewer: "
        + (", ".join(str(n) for n in fits) or "none"),
    )


def check_topology(cfg: Config, world_size: int, fail: Fail, padded_vocab: int | None = None) -> None:
    """The model, the batch and the world size split over tp x pp x dp (``padded_vocab``: already
    resolved by the caller; reading the tokenizer is not a topology rule)."""
    m, p, d = cfg.model, cfg.parallel, cfg.data
    vocab = padded_vocab if padded_vocab is not None else padded_vocab_size(cfg)
    if m.num_attention_heads % p.tp:
        fail(
            "parallel.tp",
            f"tp={p.tp} does not divide model.num_attention_heads={m.num_attention_heads}",
            "choose a tp that divides the number of heads",
        )
    groups = m.num_query_groups or m.num_attention_heads
    if m.num_attention_heads % groups or groups % p.tp:
        fail(
            "model.num_query_groups",
            f"{groups} groups do not fit {m.num_attention_heads} heads at tp={p.tp}",
            "use groups dividing the heads and divisible by tp",
        )
    if m.num_layers % p.pp:
        fail(
            "parallel.pp", f"pp={p.pp} does not divide model.num_layers={m.num_layers}", "choose pp dividing the layers"
        )
    if world_size % (p.tp * p.pp):
        fail(
            "parallel.tp",
            f"world size {world_size} is not divisible by tp*pp={p.tp * p.pp}",
            "launch a multiple of tp*pp ranks or change tp/pp",
        )
    if vocab % p.tp:
        fail(
            "model.make_vocab_size_divisible_by",
            f"padded vocab {vocab} is not divisible by tp={p.tp}",
            "use a multiple of 128 (divisible by every tp you will use)",
        )
    dp = data_parallel_size(cfg, world_size)
    if d.global_batch_size % (d.micro_batch_size * dp):
        fail(
            "data.global_batch_size",
            f"{d.global_batch_size} is not divisible by micro_batch_size*dp={d.micro_batch_size}*{dp}",
            "make the global batch a multiple of micro_batch_size*dp",
        )


def data_parallel_size(cfg: Config, world_size: int) -> int:
    return world_size // (cfg.parallel.tp * cfg.parallel.pp)


def padded_vocab_size(cfg: Config) -> int:
    """Vocabulary padded to ``make_vocab_size_divisible_by``.

    Unlike Megatron-LM we do not multiply the multiple by TP: the padded size must not depend on
    the topology, or a checkpoint saved at TP=2 would not load at TP=1. :func:`validate` checks
    that TP divides the result.
    """
    multiple = cfg.model.make_vocab_size_divisible_by
    return -(-resolve_vocab_size(cfg) // multiple) * multiple


def resolve_vocab_size(cfg: Config) -> int:
    """``model.vocab_size`` if set, else the tokenizer's vocabulary (byte: 257); never smaller than it.

    Reads the tokenizer file (offline, cached); its problems are one-line ConfigErrors naming the file.
    """
    try:
        tokenizer_size = tokenizer_vocab_size(cfg.data.tokenizer, cfg.data.tokenizer_path)
    except ConfigError as exc:
        raise ConfigError(f"{cfg.source}: data.tokenizer_path: {exc}") from None
    size = cfg.model.vocab_size
    if size is None:
        return tokenizer_size
    if size < tokenizer_size:
        Fail(cfg.source)(
            "model.vocab_size",
            f"{size} is smaller than the {cfg.data.tokenizer} tokenizer's vocabulary of {tokenizer_size}",
            f"remove it (it is derived from the tokenizer) or set it >= {tokenizer_size}",
        )
    return size

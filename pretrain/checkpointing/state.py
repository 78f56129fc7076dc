"""The training state a checkpoint holds, and the pieces every checkpoint format shares."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pretrain.config import Config, DataConfig, TrainConfig, resolve_vocab_size
from pretrain.data.sampler import GlobalBatchSampler
from pretrain.data.tokenizer import tokenizer_identity
from pretrain.errors import IncompatibleCheckpoint
from pretrain.optim import TrainOptimizer
from pretrain.platform.versions import code_version, framework_versions
from pretrain.rank_state import seed_everything
from tiering.local.publish import manifest_for
from tiering.manifest import Manifest

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
# Model fields that must match for a checkpoint to load at all (parallelism may differ).
ARCH_KEYS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "seq_length",
    "vocab_size",
    "make_vocab_size_divisible_by",
    "position_embedding",
    "normalization",
    "swiglu",
    "untie_embeddings",
)


@dataclass
class TrainingState:
    """Everything the loop mutates; every checkpoint format saves and restores all of it."""

    cfg: Config
    model: torch.nn.Module  # the unwrapped GPTModel chunk
    optimizer: TrainOptimizer
    scheduler: Any  # OptimizerParamScheduler
    sampler: GlobalBatchSampler
    topology: dict[str, int]
    dataset_snapshot: str
    step: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    # The config as every save records it, built at the first save: a run's config does not change,
    # and building it (dataclasses.asdict of ~150 values) was a third of the training thread's part
    # of a tier-0 snapshot, taken every step. Savers only read it (staging copies its containers).
    saved_config: dict[str, Any] | None = field(default=None, repr=False, compare=False)


@dataclass
class SaveResult:
    tier: str
    step: int
    seconds: float
    bytes: int
    path: Path
    under_replicated: list[int] = field(default_factory=list)
    replication_seconds: float = 0.0
    blocked_seconds: float | None = None  # training's share of the save (background saves: the snapshot)
    peer_skipped: int = 0  # tier 0: sealed slots the peer stream skipped (it fell behind) since the last save


@dataclass
class RestoreResult:
    tier: str
    step: int
    seconds: float
    verify_seconds: float
    rng_restored: bool
    rejected: list[tuple[int, str]]
    path: Path
    per_rank: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def trainer_state(state: TrainingState) -> dict[str, Any]:
    """Counters, schedule, topology, config and versions: tensors and plain values only."""
    return {
        "format_version": FORMAT_VERSION,
        "step": state.step,
        "consumed_samples": state.consumed_samples,
        "consumed_tokens": state.consumed_tokens,
        "scheduler": state.scheduler.state_dict(),
        "grad_scaler": None,  # fp32/bf16 training uses no loss scaling
        "topology": dict(state.topology),
        "config": _saved_config(state),
        "code_version": code_version(),
        "dataset_snapshot": state.dataset_snapshot,
        "tokenizer": _tokenizer_identity(state.cfg.data.tokenizer, state.cfg.data.tokenizer_path),
        "extra": dict(state.extra),
    }


def apply_trainer_state(state: TrainingState, trainer: dict[str, Any], path: Path) -> None:
    check_compatible(state.cfg, trainer, path)
    check_same_tokenizer(state.cfg.data, trainer, path)
    state.scheduler.load_state_dict(trainer["scheduler"])
    state.step = trainer["step"]
    state.consumed_samples = trainer["consumed_samples"]
    state.consumed_tokens = trainer["consumed_tokens"]
    state.extra = dict(trainer.get("extra", {}))
    if trainer["dataset_snapshot"] != state.dataset_snapshot:
        log.warning(
            "dataset snapshot changed since step %d (%s -> %s): the data order is not the one the "
            "checkpoint was trained on",
            state.step,
            trainer["dataset_snapshot"],
            state.dataset_snapshot,
        )


# Hashed once per process: every save records it, and a save must not re-read the tokenizer file.
_tokenizer_identity = functools.lru_cache(maxsize=8)(tokenizer_identity)


def _saved_config(state: TrainingState) -> dict[str, Any]:
    if state.saved_config is None:
        state.saved_config = _config_with_vocab(state.cfg)
    return state.saved_config


def _config_with_vocab(cfg: Config) -> dict[str, Any]:
    """The config as saved: ``model.vocab_size`` resolved, so a derived vocabulary is compared by its size."""
    out = cfg.to_dict()
    out["model"]["vocab_size"] = resolve_vocab_size(cfg)
    return out


def check_compatible(cfg: Config, trainer: dict[str, Any], path: Path) -> None:
    saved = trainer["config"]["model"]
    now = _config_with_vocab(cfg)["model"]
    diff = [k for k in ARCH_KEYS if saved.get(k) != now.get(k)]
    if diff:
        key = diff[0]
        raise IncompatibleCheckpoint(
            f"{path}: checkpoint has model.{key}={saved.get(key)!r} but the config says {now.get(key)!r}; "
            "fix: use the run's original model config or a new run.id"
        )


def check_same_tokenizer(data: DataConfig, trainer: dict[str, Any], path: Path) -> None:
    """A run resumes only with the tokenizer it was trained with (same kind and file digest); the
    same vocabulary size is not enough (ids would mean other text)."""
    saved = trainer.get("tokenizer")
    if not saved:  # saved before tokenizer identities were recorded
        return
    now = _tokenizer_identity(data.tokenizer, data.tokenizer_path)
    if (saved.get("kind"), saved.get("sha256")) != (now.get("kind"), now.get("sha256")):
        raise IncompatibleCheckpoint(
            f"{path}: trained with tokenizer {saved.get('kind')} {saved.get('file') or ''} "
            f"({saved.get('sha256')}), this run uses {now.get('kind')} {now.get('file') or ''} ({now.get('sha256')}); "
            "fix: set data.tokenizer and data.tokenizer_path to the run's tokenizer, or start a new run.id"
        )


def reseed_after_reshard(train: TrainConfig, step: int, rank: int) -> None:
    """Per-rank RNG streams cannot be carried to another topology: re-seed deterministically."""
    seed_everything(train.seed + 7919 * step + rank)


def step_manifest(
    run_id: str, data: DataConfig, state: TrainingState, fmt: str, attempt: str, **extra: Any
) -> Manifest:
    """The manifest of ``state``'s step of run ``run_id``; ``data``: the run's data section (its tokenizer)."""
    return manifest_for(
        run_id,
        state.step,
        state.topology["world_size"],
        {k: v for k, v in state.topology.items() if k != "world_size"},
        framework=framework_versions(),
        code_version=code_version(),
        dataset_snapshot=state.dataset_snapshot,
        format=fmt,
        extra={
            "consumed_samples": state.consumed_samples,
            "consumed_tokens": state.consumed_tokens,
            "attempt": attempt,
            "tokenizer": _tokenizer_identity(data.tokenizer, data.tokenizer_path),
            **extra,
        },
    )


def one_line(exc: BaseException) -> str:
    """One line naming the root cause; unwraps torch's per-rank CheckpointException."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = getattr(inner, "exc", inner)
        if isinstance(inner, tuple):  # Megatron's async writer reports (exception, traceback frames)
            inner = inner[0]
        if isinstance(inner, BaseException):
            exc = inner
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"

"""Complete training-state checkpoints on the local tier, saved and restored collectively.

A step directory holds:

* ``model/``: a Megatron distributed checkpoint of the model and the optimizer state, both as
  ShardedTensors keyed to the parameters (reshardable across TP/PP/DP);
* ``trainer.pt``: step, consumed samples/tokens, LR scheduler, grad scaler, topology, config,
  code and framework versions, dataset snapshot (rank 0; tensors and plain values only);
* ``rank-state/rank-NNNNN.pt``: per-rank RNG streams and data cursor;
* ``manifest.json`` + ``COMMITTED`` from the publish protocol (:mod:`tiering.publish`).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.api import CheckpointException

from pretrain.config import Config
from pretrain.data.dataset import GlobalBatchSampler
from pretrain.optim import TrainOptimizer
from pretrain.rank_state import rank_state, restore_rng, seed_everything
from pretrain.versions import code_version, framework_versions
from tiering.collective import Collective
from tiering.errors import PublishError
from tiering.fsio import dir_size
from tiering.local import LocalTier
from tiering.manifest import Manifest
from tiering.publish import PosixStepPublisher, manifest_for
from tiering.restore import select_newest_verified

log = logging.getLogger(__name__)

FORMAT = "megatron-dist+rank-state/v1"
FORMAT_VERSION = 1
# Model fields that must match for a checkpoint to load at all (parallelism may differ).
_ARCH_KEYS = (
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


class IncompatibleCheckpoint(RuntimeError):
    """The newest verified checkpoint belongs to a different model; refusing to load it."""


@dataclass
class TrainingState:
    """Everything the loop mutates; the checkpoint saves and restores all of it."""

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


@dataclass
class SaveResult:
    step: int
    seconds: float
    bytes: int
    path: Path


@dataclass
class RestoreResult:
    tier: str
    step: int
    seconds: float
    verify_seconds: float
    rng_restored: bool
    rejected: list[tuple[int, str]]
    path: Path


class CheckpointManager:
    def __init__(self, cfg: Config, coll: Collective, attempt: str) -> None:
        self.cfg = cfg
        self.coll = coll
        self.tier = LocalTier(cfg.checkpoint.local.dir, cfg.run.id, cfg.checkpoint.local.keep)
        self.publisher = PosixStepPublisher(self.tier.layout, coll, attempt)
        self.attempt = attempt
        self._last_step_bytes = 0
        self._warmup = start_writer_warmup()

    def prepare(self) -> None:
        """At start-up (old world gone): drop temporary directories left by earlier attempts."""
        if self.coll.rank == 0:
            for path in self.tier.clean_stale_tmp(self.attempt):
                log.info("removed unfinished save of an earlier attempt: %s", path)
        self.coll.barrier()

    # -- save ------------------------------------------------------------------------------------
    def save(self, state: TrainingState) -> SaveResult:
        """Collective. Raises PublishError (on every rank) if the step could not be published."""
        t0 = time.perf_counter()
        self._warmup.join()
        tmp = self.publisher.begin(state.step, expected_bytes=self._last_step_bytes)
        error = None
        try:
            self._write(tmp, state)
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            free = shutil.disk_usage(tmp.parent).free
            error = f"{_one_line(exc)}; {free / 1e6:.1f} MB free on {tmp.parent}"
            log.error("rank %d: writing step %d failed: %s", self.coll.rank, state.step, error)
        manifest = self._manifest(state)
        self.publisher.commit(tmp, manifest, local_error=error)
        self._last_step_bytes = manifest.total_bytes
        if self.coll.rank == 0:
            for step in self.tier.apply_retention():
                log.info("retention: deleted step %d (keep=%d)", step, self.cfg.checkpoint.local.keep)
        self.coll.barrier()
        return SaveResult(state.step, time.perf_counter() - t0, manifest.total_bytes, self.tier.step_path(state.step))

    def _write(self, tmp: Path, state: TrainingState) -> None:
        (tmp / "model").mkdir(exist_ok=True)
        (tmp / "rank-state").mkdir(exist_ok=True)
        model_sd = state.model.sharded_state_dict()
        optim_sd = state.optimizer.sharded_state_dict(model_sd, kind="reshardable")
        dist_checkpointing.save({"model": model_sd, "optimizer": optim_sd}, str(tmp / "model"))
        cursor = state.sampler.cursor(state.consumed_samples)
        torch.save(
            rank_state(self.coll.rank, state.topology, cursor), tmp / "rank-state" / f"rank-{self.coll.rank:05d}.pt"
        )
        if self.coll.rank == 0:
            torch.save(self._trainer_state(state), tmp / "trainer.pt")

    def _trainer_state(self, state: TrainingState) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "step": state.step,
            "consumed_samples": state.consumed_samples,
            "consumed_tokens": state.consumed_tokens,
            "scheduler": state.scheduler.state_dict(),
            "grad_scaler": None,  # fp32/bf16 training uses no loss scaling
            "topology": dict(state.topology),
            "config": state.cfg.to_dict(),
            "code_version": code_version(),
            "dataset_snapshot": state.dataset_snapshot,
            "extra": dict(state.extra),
        }

    def _manifest(self, state: TrainingState) -> Manifest:
        return manifest_for(
            self.cfg.run.id,
            state.step,
            state.topology["world_size"],
            {k: v for k, v in state.topology.items() if k != "world_size"},
            framework=framework_versions(),
            code_version=code_version(),
            dataset_snapshot=state.dataset_snapshot,
            format=FORMAT,
            extra={
                "consumed_samples": state.consumed_samples,
                "consumed_tokens": state.consumed_tokens,
                "attempt": self.attempt,
            },
        )

    # -- restore ---------------------------------------------------------------------------------
    def restore(self, state: TrainingState) -> RestoreResult | None:
        """Collective: load the newest verified step into ``state``; None if there is none."""
        t0 = time.perf_counter()
        selection = select_newest_verified(self.tier, self.coll)
        verify_s = time.perf_counter() - t0
        if selection is None:
            return None
        path = self.tier.step_path(selection.step)
        trainer = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
        self._check_compatible(trainer, path)
        model_sd = state.model.sharded_state_dict()
        optim_sd = state.optimizer.sharded_state_dict(model_sd, kind="reshardable")
        loaded = dist_checkpointing.load({"model": model_sd, "optimizer": optim_sd}, str(path / "model"))
        state.model.load_state_dict(loaded["model"], strict=True)
        state.optimizer.load_sharded_state_dict(loaded["optimizer"])
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
        rng_restored = self._restore_rank_state(path, trainer, state)
        self.coll.barrier()
        return RestoreResult(
            selection.tier, selection.step, time.perf_counter() - t0, verify_s, rng_restored, selection.rejected, path
        )

    def _check_compatible(self, trainer: dict[str, Any], path: Path) -> None:
        saved = trainer["config"]["model"]
        now = self.cfg.to_dict()["model"]
        diff = [k for k in _ARCH_KEYS if saved.get(k) != now.get(k)]
        if diff:
            key = diff[0]
            raise IncompatibleCheckpoint(
                f"{path}/trainer.pt: checkpoint has model.{key}={saved.get(key)!r} but the config says "
                f"{now.get(key)!r}; fix: use the run's original model config or a new run.id"
            )

    def _restore_rank_state(self, path: Path, trainer: dict[str, Any], state: TrainingState) -> bool:
        """Per-rank RNG when the topology is unchanged; otherwise a deterministic re-seed."""
        rank_file = path / "rank-state" / f"rank-{self.coll.rank:05d}.pt"
        if trainer["topology"] == state.topology and rank_file.is_file():
            restore_rng(torch.load(rank_file, map_location="cpu", weights_only=True)["rng"])
            return True
        if self.coll.rank == 0:
            log.warning(
                "topology changed (%s -> %s): model, optimizer and data cursor are resharded; per-rank "
                "RNG streams are re-seeded from (train.seed, step)",
                trainer["topology"],
                state.topology,
            )
        seed_everything(self.cfg.train.seed + 7919 * state.step + self.coll.rank)
        return False

    def step_size_bytes(self, step: int) -> int:
        return dir_size(self.tier.step_path(step))


_warmup_lock = threading.Lock()
_warmup_thread: threading.Thread | None = None


def start_writer_warmup() -> threading.Thread:
    """Start Megatron's checkpoint-writer Manager once per process, in the background.

    Megatron's file writer starts a spawn-context multiprocessing Manager on its first save (~2.5 s
    here); warming it at start-up keeps that off the step. One thread per process: two concurrent
    first calls would race on Megatron's unguarded module global.
    """
    global _warmup_thread
    with _warmup_lock:
        if _warmup_thread is None:
            _warmup_thread = threading.Thread(target=_warm_up_writer, name="ckpt-writer-warmup", daemon=True)
            _warmup_thread.start()
        return _warmup_thread


def _warm_up_writer() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._get_write_results_queue()


def _one_line(exc: BaseException) -> str:
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


__all__ = [
    "CheckpointManager",
    "TrainingState",
    "SaveResult",
    "RestoreResult",
    "PublishError",
    "IncompatibleCheckpoint",
]

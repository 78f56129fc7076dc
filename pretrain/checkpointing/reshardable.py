"""Reshardable checkpoints: Megatron distributed checkpoints, saved and restored collectively.

A step directory holds:

* ``model/``: a Megatron distributed checkpoint of the model and the optimizer state, both as
  ShardedTensors keyed to the parameters (loadable at another TP/PP/DP);
* ``trainer.pt``: step, consumed samples/tokens, LR scheduler, grad scaler, topology, config,
  code and framework versions, dataset snapshot (rank 0; tensors and plain values only);
* ``rank-state/rank-NNNNN.pt``: per-rank RNG streams and data cursor;
* ``manifest.json`` + ``COMMITTED`` from the publish protocol (:mod:`tiering.local.publish`), and
  ``SIGNATURE``, the manifest's HMAC under the run key (:mod:`tiering.trust.signature`): checked on every
  rank before any byte is hashed or any DCP metadata is read; a step whose signature is missing or
  forged is quarantined and the next older signed step restored.

The directory must be visible to every rank (shared storage, or the staging area of the S3 tier).

Shared storage stalls (an NFS or Lustre server that stops answering): a write there waits in the
kernel for as long as it does. The tier's health (:mod:`pretrain.checkpointing.tier_health`, one rule for every tier)
decides, the same on every rank: at the start of an attempt a probe per node (if one does not
answer, nothing of the attempt touches the tier: no check, no cleaning, no listing, no restore, no
S3 download into it; the restore goes on with the other tiers); during a background save, a
writer idle past the deadline while a probe goes unanswered as long (the save is abandoned: its
writer and the workers it started are SIGKILLed and, if the kernel holds them, left behind
without being waited for, at exit too; the step is not published and the tier's saves are skipped
until the storage answers). Training goes on meanwhile.

What still runs on the rank's thread and can block there: the begin and commit of a step (small
files, the manifest, the rename), retention, Megatron's ``common.pt`` and ``.metadata``. A stall
that starts there holds the rank until its section timeout kills it; the standby process then
tells the launcher the rank ended (:mod:`pretrain.resilience.standby.server`), and the restarted
attempt's probe finds the storage stalled and leaves the tier alone.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.process
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.base import LoadShardedStrategy
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from torch.distributed.checkpoint.api import CheckpointException

from pretrain.checkpointing import dcp_metadata
from pretrain.checkpointing.async_writer import killed_by_signal
from pretrain.checkpointing.shared_storage import check_shared
from pretrain.checkpointing.state import (
    RestoreResult,
    SaveResult,
    TrainingState,
    apply_trainer_state,
    one_line,
    reseed_after_reshard,
    step_manifest,
    trainer_state,
)
from pretrain.checkpointing.tier_health import (
    STALLED,
    AgreedTierHealth,
    TierHealth,
    WriteProgress,
    WriteWatch,
    log_stall,
    process_tree,
)
from pretrain.config import Config
from pretrain.platform.compat import (
    async_save_kwargs,
    drain_write_results,
    reset_write_results_queue,
    warm_write_results_queue,
)
from pretrain.rank_state import rank_state, restore_rng
from pretrain.resilience.faults import hanging_writer, staging_writer_fault
from pretrain.resilience.phases import PhaseRecord
from tiering.collective import Collective
from tiering.digest import PORTABLE_HASH, HashSpec
from tiering.errors import PublishError, VerificationError
from tiering.local.posix import PosixTier
from tiering.local.publish import PosixStepPublisher
from tiering.local.restore import select_newest_verified
from tiering.trust.signature import ManifestSigner
from tiering.verify import verify_step

log = logging.getLogger(__name__)

FORMAT = "megatron-dist+rank-state/v1"
RESHARDABLE_SKIPPED = "reshardable tier skipped"  # how a restore says it did not wait on a stalled tier
WRITER_EXIT_WAIT_S = 2.0  # a killed writer not gone by then is held by the kernel (stalled storage)
POLL_S = 0.01  # a blocking wait for the writers polls them (and the deadline) this often


def save_strategy() -> FullyParallelSaveStrategyWrapper:
    """Megatron's default save strategy spread over the data-parallel group, as Megatron's trainer
    does (``--ckpt-fully-parallel-save``): each DP replica writes a share of the replicated shards,
    not DP rank 0's nodes all of them. Metadata only crosses ranks (works on gloo).

    A new strategy per save, not Megatron's constant-structure cache (one kept, its plans reused:
    half the blocked time, measured): the cached plans put DCP's ``_StoragePrefix`` objects into
    ``.metadata``, which :mod:`pretrain.checkpointing.dcp_metadata` refuses to unpickle: later steps unreadable."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), group)


def load_strategy(checkpoint_dir: Path, base: LoadShardedStrategy | None = None) -> FullyParallelLoadStrategyWrapper:
    """Megatron's default load strategy (or ``base``) spread over the data-parallel group, as
    Megatron's trainer does (``--ckpt-fully-parallel-load``): each DP replica reads a share of the
    replicated shards and the shares are exchanged, so storage reads are not multiplied by DP. The
    exchange: broadcasts of device tensors on CUDA; on CPU ``gather_object`` (Megatron 0.16.1's
    broadcast exchange moves every share to ``cuda``), the same distribution of the reads."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    strategy = base if base is not None else get_default_load_sharded_strategy(str(checkpoint_dir))
    exchange = "broadcast" if torch.cuda.is_available() else "gather_object"
    return FullyParallelLoadStrategyWrapper(strategy, group, exchange_algo=exchange)


class ReshardableCheckpoints:
    name = "reshardable"
    within_step = False

    def __init__(
        self,
        cfg: Config,
        coll: Collective,
        attempt: str,
        directory: str | None = None,
        record_event: Any = None,
        phases: PhaseRecord | None = None,
        signer: ManifestSigner | None = None,
    ) -> None:
        """``signer``: the run key's manifest signer; every step saved here gets its ``SIGNATURE``
        and a step without a good one is never restored (:mod:`tiering.trust.signature`). None only where
        no tier moves or signs steps (a test of the tier alone)."""
        self.cfg = cfg
        self.phases = phases
        self.coll = coll
        tier_cfg = cfg.checkpoint.reshardable
        self.tier = PosixTier(
            directory or tier_cfg.dir,
            cfg.run.id,
            tier_cfg.keep,
            name=self.name,
            expect_hash=PORTABLE_HASH,
            signer=signer,
        )
        # What S3 receives carries a cryptographic digest (blake3); each rank hashes its share of
        # the files Megatron wrote at commit, on at most hash_threads threads.
        integrity = cfg.checkpoint.integrity
        hashing = HashSpec(PORTABLE_HASH, integrity.chunk_bytes, integrity.hash_threads)
        self.publisher = PosixStepPublisher(self.tier.layout, coll, attempt, hashing, signer)
        self.attempt = attempt
        self._last_step_bytes = 0
        self._warmup = start_writer_warmup()
        self._record_event = record_event
        self._queue = _new_queue()
        self._inflight: dict[str, Any] | None = None
        # Whether the next non-blocking poll may finalize (see poll_fits_in_step): agreed per step.
        self._may_finalize = True
        # One rank per node probes: a node's ranks share its mount (see tier_health).
        probe_dir = self.tier.layout.run_dir / ".health" / f"probe-{coll.rank:05d}"
        health = TierHealth(probe_dir, tier_cfg.probe_interval_s, "reshardable")
        probes = os.environ.get("LOCAL_RANK", "0") == "0"
        self.storage = AgreedTierHealth(health, coll, tier_cfg.stall_timeout_s, self._report_stall, probes)

    def prepare(self) -> None:
        """At start-up (old world gone): probe the storage (see the module docstring); if it answers
        on every node, refuse a directory that not every rank sees (now, not at the first save hours
        in: :mod:`pretrain.checkpointing.shared_storage`) and drop temporary directories left by
        earlier attempts."""
        if not self.storage.probe_at_start():
            return
        node = os.environ.get("NODE_NAME") or os.uname().nodename
        check_shared(self.tier.layout.run_dir, self.attempt, self.coll, node)
        if self.coll.rank == 0:
            for path in self.tier.clean_stale_tmp(self.attempt):
                log.info("removed unfinished save of an earlier attempt: %s", path)
        self.coll.barrier()

    def _report_stall(self, what: str) -> None:
        probe_s = self.cfg.checkpoint.reshardable.probe_interval_s
        log_stall(self.coll.rank, "reshardable tier", self.tier.layout.run_dir, what, "checkpoint.reshardable", probe_s)

    def stalled_note(self) -> str | None:
        """Collective, non-blocking: None if every rank may read the tier now; else the restore's
        note saying why it did not wait on it (the first stalled rank named)."""
        why = self.storage.agreed_healthy()
        return None if why is None else f"{RESHARDABLE_SKIPPED}: {why}"

    def newest_committed(self) -> int | None:
        """Rank 0's cheap look (no hashing) at the newest committed step, shared with every rank."""
        steps = self.tier.committed_steps() if self.coll.rank == 0 else None
        steps = self.coll.broadcast(steps)
        return steps[0] if steps else None

    # -- save ------------------------------------------------------------------------------------
    def due(self, step: int, final: bool) -> bool:
        """Every reshardable interval, every S3 interval (promotion staging) and the last step."""
        s3 = self.cfg.checkpoint.s3
        every = [self.cfg.checkpoint.reshardable.interval] + ([s3.interval] if s3.uri and s3.interval else [])
        return final or any(step % n == 0 for n in every)

    def save(self, state: TrainingState, deadline: float | None = None) -> SaveResult:
        """Collective, synchronous. Raises PublishError (on every rank) if the step could not be published.
        (``deadline`` is for the emergency tier-1 save; promotion staging is never one.)"""
        t0 = time.perf_counter()
        self.storage.skip_if_stalled(state.step)
        self._warmup.join()
        tmp = self.publisher.begin(state.step, expected_bytes=self._last_step_bytes)
        error = None
        try:
            self._write(tmp, state, background=False)
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            error = self._write_error(tmp, state.step, exc)
        manifest = step_manifest(self.cfg.run.id, self.cfg.data, state, FORMAT, self.attempt)
        return self._commit(state.step, tmp, manifest, error, t0, blocked=None)

    # -- background saves (Megatron's async dist-checkpoint save) -----------------------------------
    @property
    def in_flight(self) -> int | None:
        """The step being written in the background, if any."""
        return self._inflight["step"] if self._inflight is not None else None

    def busy(self) -> bool:
        """Is a save in flight? The same answer on every rank: Megatron finalizes collectively."""
        return self.in_flight is not None

    def start_async(self, state: TrainingState) -> float:
        """Collective: plan the save, write the small per-rank files, and hand the shards to a
        forked writer (copy-on-write snapshot); returns the seconds training was blocked.
        :meth:`poll_async` publishes the step once every rank's writer is done."""
        assert self._inflight is None, "one reshardable save in flight at most"
        t0 = time.perf_counter()
        self.storage.skip_if_stalled(state.step)
        self._warmup.join()
        tmp = self.publisher.begin(state.step, expected_bytes=self._last_step_bytes)
        error = None
        scheduled = False
        try:
            request = self._write(tmp, state, background=True)
            if staging_writer_fault(self.cfg.fault_tolerance.inject, self.coll.rank, state.step) == "hang":
                request = request._replace(async_fn=hanging_writer)
            self._queue.schedule_async_request(request)
            scheduled = True
        except (Exception, CheckpointException) as exc:
            error = self._write_error(tmp, state.step, exc)
        errors = [e for e in self.coll.all_gather(error) if e]
        if errors and scheduled:
            self._drop_queue()  # another rank could not start: its writer never finalizes with ours
        blocked = time.perf_counter() - t0
        manifest = step_manifest(self.cfg.run.id, self.cfg.data, state, FORMAT, self.attempt)
        writer = self._writer_process() if scheduled else None
        self._inflight = {"step": state.step, "tmp": tmp, "manifest": manifest, "t0": t0, "blocked": blocked}
        self._inflight["error"] = error or (f"another rank failed to start its writer: {errors[0]}" if errors else None)
        self._inflight["watch"] = self.storage.watch(WriteProgress(writer.pid) if writer is not None else None)
        if self._record_event is not None:
            pid = writer.pid if writer is not None else None
            self._record_event("save_started", tier=self.name, step=state.step, writer_pid=pid, blocked=blocked)
        return blocked

    def poll_async(self, block: bool = False, stop_when_idle: bool = False) -> SaveResult | None:
        """Collective while a save is in flight (every rank, every step): None while any rank's
        writer runs (unless ``block``); the SaveResult once published; PublishError on every rank
        if a writer failed, died or stalled (nothing is committed, older steps are intact)."""
        entry = self._inflight
        if entry is None:
            return None
        error = entry["error"]
        if error is None:
            done, error = self._writers_done(entry, block, stop_when_idle)
            if not done:
                return None
        self._inflight = None
        if error is not None and error.startswith(STALLED):
            # Nothing more is asked of the stalled storage: the unfinished step's directory stays
            # until an attempt finds the storage answering (prepare() removes it).
            self.storage.stalled(error, entry["watch"].confirm)
            raise PublishError(f"step {entry['step']} is not published in the reshardable tier: {error}")
        return self._commit(entry["step"], entry["tmp"], entry["manifest"], error, entry["t0"], entry["blocked"])

    def poll_fits_in_step(self) -> bool:
        """Collective: True while some rank's writer still runs, and then the next non-blocking
        poll does not finalize even if the last writer ends meanwhile (only the stall verdict is
        asked): Megatron's finalize and the commit write to shared storage on the training thread,
        and are judged by the checkpointing section, as a save, at the next step."""
        entry = self._inflight
        if entry is None or entry["error"] is not None:
            return entry is None
        writer = self._writer_process()
        ended = all(self.coll.all_gather(writer is None or writer.exitcode is not None))
        self._may_finalize = ended
        return not ended

    def _writers_done(self, entry: dict[str, Any], block: bool, stop_when_idle: bool) -> tuple[bool, str | None]:
        """Collective: (every rank's writer ended, the error if one failed or stalled: see
        :class:`~pretrain.checkpointing.tier_health.WriteWatch`); ``block`` waits until the
        writers end or stall, or (``stop_when_idle``) some writer has written nothing for the stall
        deadline (a stall is suspected: its verdict takes a deadline more, which a rank waiting
        for it inside the checkpointing section may not live to see)."""
        writer = self._writer_process()
        watch: WriteWatch = entry["watch"]
        may_finalize, self._may_finalize = self._may_finalize or block, True  # agreed for this poll only
        while True:
            try:
                if may_finalize and self._queue.maybe_finalize_async_calls(blocking=False):
                    return True, None
            except (Exception, CheckpointException) as exc:  # raised on every rank by Megatron
                code = writer.exitcode if writer is not None else None
                self._drop_queue()
                if code is not None and code < 0:  # Megatron only sees the missing results
                    return True, killed_by_signal(writer.pid, -code)
                return True, f"background writer failed: {one_line(exc)}"
            stalled = watch.verdict(writer_ended=writer is None or writer.exitcode is not None)
            if stalled is not None:
                self._drop_queue(wait_s=0.0)  # a writer held in the kernel exits only once the storage answers
                return True, f"{stalled}; step {entry['step']} was being written to {entry['tmp']}"
            if not block or (stop_when_idle and watch.longest_idle_s >= self.storage.deadline()):
                return False, None
            time.sleep(POLL_S)

    def _writer_process(self) -> Any:
        """The forked process writing the oldest save in flight (None once joined)."""
        calls = self._queue.async_calls
        return getattr(calls[0].async_caller, "process", None) if calls else None

    def abandon_async(self) -> None:
        """Leaving without publishing (an exception unwinds the loop): stop the forked writer."""
        if self._inflight is not None:
            self._drop_queue()
        self._inflight = None

    def _drop_queue(self, wait_s: float = WRITER_EXIT_WAIT_S) -> None:
        """Kill the writers still running and start a fresh queue. Not Megatron's
        ``close(abort=True)``: it asks torch.distributed for the rank, and an in-process
        restart may already have destroyed the process group."""
        for call in self._queue.async_calls:
            process = getattr(call.async_caller, "process", None)
            if process is not None:
                for pid in process_tree(process.pid):  # the writer and the workers it started
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                process.join(wait_s)
                if process.is_alive():
                    _leave_behind(process)
        self._queue = _new_queue()
        drain_write_results()  # what a finished writer left there must not be read by the next save

    def _write_error(self, tmp: Path, step: int, exc: BaseException) -> str:
        free = shutil.disk_usage(tmp.parent).free
        error = f"{one_line(exc)}; {free / 1e6:.1f} MB free on {tmp.parent}"
        log.error("rank %d: writing step %d failed: %s", self.coll.rank, step, error)
        return error

    def _commit(
        self, step: int, tmp: Path, manifest: Any, error: str | None, t0: float, blocked: float | None
    ) -> SaveResult:
        """Collective tail of every save: publish (or abort everywhere), then retention."""
        self.publisher.commit(tmp, manifest, local_error=error)
        self._last_step_bytes = manifest.total_bytes
        self.storage.agree_slowest(time.perf_counter() - t0)
        if self.coll.rank == 0:
            for old in self.tier.apply_retention():
                log.info("retention: deleted reshardable step %d (keep=%d)", old, self.cfg.checkpoint.reshardable.keep)
        self.coll.barrier()
        return SaveResult(
            self.name,
            step,
            time.perf_counter() - t0,
            manifest.total_bytes,
            self.tier.step_path(step),
            blocked_seconds=blocked,
        )

    def _write(self, tmp: Path, state: TrainingState, background: bool) -> Any:
        """Write this rank's part of ``tmp``; in the background, the shards are left to the
        returned Megatron async request (the small per-rank files are written now)."""
        (tmp / "model").mkdir(exist_ok=True)
        (tmp / "rank-state").mkdir(exist_ok=True)
        model_sd = state.model.sharded_state_dict()
        optim_sd = state.optimizer.sharded_state_dict(model_sd, kind="reshardable")
        request = dist_checkpointing.save(
            {"model": model_sd, "optimizer": optim_sd},
            str(tmp / "model"),
            save_strategy(),
            async_sharded_save=background,
            **(async_save_kwargs() if background else {}),
        )
        cursor = state.sampler.cursor(state.consumed_samples)
        rank_file = tmp / "rank-state" / f"rank-{self.coll.rank:05d}.pt"
        torch.save(rank_state(self.coll.rank, state.topology, cursor), rank_file)
        if self.coll.rank == 0:
            torch.save(trainer_state(state), tmp / "trainer.pt")
        return request

    # -- restore ---------------------------------------------------------------------------------
    def restore(
        self,
        state: TrainingState,
        newer_than: int = -1,
        rejected: list[tuple[int, str]] | None = None,
        exclude: frozenset[int] = frozenset(),
    ) -> RestoreResult | None:
        """Collective: load the newest verified step newer than ``newer_than`` into ``state``; None
        if there is none (rejections are appended to ``rejected`` when given). Steps in ``exclude``
        (the run's suspects) are never loaded."""
        t0 = time.perf_counter()
        if self.phases is not None:
            self.phases.enter("verify")
        selection = select_newest_verified(
            self.tier, self.coll, newer_than, rejected, check=dcp_metadata.check_step, exclude=exclude
        )
        verify_s = time.perf_counter() - t0
        if selection is None:
            return None
        path = self.tier.step_path(selection.step)
        # Shared staging: the uploader's or an operator's retention must not delete it under us.
        pin = self.tier.pin(selection.step, "restore") if self.coll.rank == 0 else None
        try:
            if self.phases is not None:
                self.phases.enter("load")
            rng_restored = self._load(path, state)
        finally:
            if pin is not None:
                pin.release()
        return RestoreResult(
            self.name, selection.step, time.perf_counter() - t0, verify_s, rng_restored, selection.rejected, path
        )

    def _load(self, path: Path, state: TrainingState) -> bool:
        """Collective: a verified step directory into ``state`` at this topology; whether the
        per-rank RNG streams were restored (same topology) or re-seeded."""
        trainer = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
        apply_trainer_state(state, trainer, path / "trainer.pt")
        model_sd = state.model.sharded_state_dict()
        # A load template, as Megatron's own loader asks for it (megatron/training/checkpointing.py,
        # core_r0.19.0 L2280): the DistributedOptimizer allocates its state for it first.
        optim_sd = state.optimizer.sharded_state_dict(model_sd, kind="reshardable", is_loading=True)
        dcp_metadata.install()  # DCP's own read of .metadata: the restricted unpickler too
        loaded = dist_checkpointing.load(
            {"model": model_sd, "optimizer": optim_sd}, str(path / "model"), load_strategy(path / "model")
        )
        state.model.load_state_dict(loaded["model"], strict=True)
        state.optimizer.load_sharded_state_dict(loaded["optimizer"])
        rng_restored = self._restore_rank_state(path, trainer, state)
        self.coll.barrier()
        return rng_restored

    def load_step_dir(self, path: Path, state: TrainingState) -> None:
        """Collective: verify one published step directory (rank 0 hashes every byte) and load it.
        Raises VerificationError naming the file on every rank if it does not verify."""
        error = None
        if self.coll.rank == 0:
            try:
                verify_step(path, expect_run_id=self.cfg.run.id, signer=self.tier.signer)
            except VerificationError as exc:
                error = (exc.path, exc.reason)
        error = self.coll.broadcast(error)
        if error:
            raise VerificationError(error[0], error[1], "fix: pass a step that verifies (see 'tiering verify')")
        self._load(path, state)

    def _restore_rank_state(self, path: Path, trainer: dict, state: TrainingState) -> bool:
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
        reseed_after_reshard(self.cfg.train, state.step, self.coll.rank)
        return False


def _leave_behind(process: Any) -> None:
    """A killed writer the kernel still holds (its write waits on stalled storage): it exits once the
    storage answers. It is dropped from multiprocessing's children, whose exit handler would
    otherwise wait for it when the rank exits (private, but the only registry there is)."""
    log.warning(
        "background writer (pid %d) is stuck in the kernel on stalled storage: left behind, it exits once "
        "the storage answers",
        process.pid,
    )
    multiprocessing.process._children.discard(process)  # type: ignore[attr-defined]


def _new_queue() -> Any:
    """Megatron's queue of background dist-checkpoint writes: each one a forked process (its
    copy-on-write memory is the snapshot); the persistent worker shares memory (torn on CPU)."""
    return AsyncCallsQueue(persistent=False)


_warmup_lock = threading.Lock()
_warmup_thread: threading.Thread | None = None
# After an in-process restart: the warm-up of the incarnation that failed (it may still be
# starting a Manager) and whether the Manager it left must be dropped.
_abandoned_warmup: threading.Thread | None = None
_writer_stale = False


def start_writer_warmup() -> threading.Thread:
    """Start Megatron's checkpoint-writer Manager once per process, in the background.

    Megatron's file writer starts a spawn-context multiprocessing Manager on its first save (~2.5 s
    here); warming it at start-up keeps that off the step. One thread per process: two concurrent
    first calls would race on Megatron's unguarded module global.
    """
    global _warmup_thread, _abandoned_warmup, _writer_stale
    with _warmup_lock:
        if _warmup_thread is None:
            abandoned, stale = _abandoned_warmup, _writer_stale
            _abandoned_warmup, _writer_stale = None, False
            _warmup_thread = threading.Thread(
                target=_warm_up_writer, args=(abandoned, stale), name="ckpt-writer-warmup", daemon=True
            )
            _warmup_thread.start()
        return _warmup_thread


def wait_for_writer_warmup() -> None:
    """Let a running warm-up finish. Call before the process exits: a Manager still starting at
    exit has no finalizer yet, and multiprocessing's exit handler would wait for it forever."""
    with _warmup_lock:
        threads = [t for t in (_warmup_thread, _abandoned_warmup) if t is not None]
    for thread in threads:
        thread.join()


def _warm_up_writer(abandoned: threading.Thread | None, stale: bool) -> None:
    if abandoned is not None:
        abandoned.join()  # it would overwrite the global below
    if stale:
        reset_write_results_queue()
    warm_write_results_queue()


def reset_writer() -> None:
    """After an in-process restart: forget Megatron's writer Manager (its process does not survive
    the restart; the next save would get a broken pipe); the next incarnation's warm-up drops it
    and starts a new one. Nothing here waits: a warm-up still running is left to finish in the
    background instead of delaying the restart."""
    global _warmup_thread, _abandoned_warmup, _writer_stale
    with _warmup_lock:
        if _warmup_thread is not None:
            _abandoned_warmup, _warmup_thread = _warmup_thread, None
        _writer_stale = True

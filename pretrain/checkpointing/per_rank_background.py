"""Background saves of tiers 1-2: the writer in flight, then its publish on a thread of its own.

:class:`BackgroundSaves` holds the background half of
:class:`~pretrain.checkpointing.per_rank.PerRankCheckpoints` (its base class): snapshot this rank's
state and write it in a writer (thread or forked process, :mod:`pretrain.checkpointing.async_writer`),
agree with every rank when the writers are done, then run the commit, replication and retention
(``PerRankCheckpoints._publish``) on a :class:`PublishInFlight` thread, off the training step. A
writer or publish past the stall deadline is abandoned and the tier marked stalled through the
tier's storage health (``storage``, :class:`~pretrain.checkpointing.tier_health.AgreedTierHealth`,
and ``_stalled``). It never commits, replicates or restores by itself: it uses the tier's ``store``,
``publisher``, ``replicator``, ``storage``, ``_payload``, ``_needed_bytes``, ``_make_room`` and ``_publish``. Only
``PerRankCheckpoints`` uses it.
"""

from __future__ import annotations

import copy
import shutil
import threading
import time
from typing import Any

import torch

from pretrain.checkpointing.async_writer import BackgroundWrite
from pretrain.checkpointing.rank_payload import FORMAT, HOST_COPIES, STATE_FILE
from pretrain.checkpointing.state import SaveResult, TrainingState, one_line, step_manifest
from pretrain.checkpointing.tier_health import STALLED
from pretrain.resilience.faults import writer_fault
from tiering.errors import PublishError, TieringError


class BackgroundSaves:
    """The background saves of :class:`~pretrain.checkpointing.per_rank.PerRankCheckpoints`: a
    save in flight (``_inflight``: its writer) and then its publish (``_publishing``)."""

    @property
    def in_flight(self) -> int | None:
        """The step being written or published in the background on this rank, if any."""
        if self._inflight is not None:
            return self._inflight["step"]
        return self._publishing.step if self._publishing is not None else None

    def busy(self) -> bool:
        """Collective: is a save still in flight on any rank? (Ranks finish publishing at
        different times; they must agree before starting or skipping the next save.)"""
        return any(self.coll.all_gather(self.in_flight is not None))

    def start_async(self, state: TrainingState) -> float:
        """Snapshot this rank's state and write it in the background; returns the seconds training
        was blocked. Every rank starts at the same step; :meth:`poll_async` publishes it."""
        assert self.in_flight is None, "one tier-1 save in flight at most"
        step = state.step
        self.storage.skip_if_stalled(step)
        t0 = time.perf_counter()
        tmp = self.store.layout.tmp_dir(step, self.attempt)
        entry: dict[str, Any] = {"step": step, "t0": t0, "tmp": tmp, "write": None, "error": None}
        try:
            entry["manifest"] = step_manifest(
                self.cfg.run.id, self.cfg.data, state, FORMAT, self.attempt, owner_rank=self.rank
            )
            fault = writer_fault(self.cfg.fault_tolerance.inject, self.rank, step)
            payload = self._payload(state)
            mode = self._async_mode()
            if self._keep_host_copy and mode == "fork":  # the thread writer's own copy serves instead
                entry["host_copy"] = copy.deepcopy(payload)
            # A snapshot kept as the host copy cannot share buffers with the next save.
            buffers = None if self._keep_host_copy else self._buffers
            expected = self._needed_bytes()

            def make_tmp_dir() -> None:  # in the writer: a mkdir can stall behind writeback
                self.publisher.begin(step, expected, lambda: self._make_room(step))

            entry["write"] = BackgroundWrite(
                mode,
                payload,
                tmp / STATE_FILE,
                fault,
                buffers,
                prepare=make_tmp_dir,
                hashing=self.hashing,
                slow_s=self.cfg.fault_tolerance.inject.writer_slow_seconds,
            )
        except (TieringError, OSError) as exc:  # storage said no; a bug (TypeError, ...) fails the attempt
            entry["error"] = str(exc)
        entry["blocked"] = time.perf_counter() - t0
        self._inflight = entry
        write = entry["write"]
        if self._record_event is not None and write is not None:
            self._record_event(
                "save_started", durable=False, tier="local", step=step, writer_pid=write.pid, blocked=entry["blocked"]
            )
        return entry["blocked"]

    def poll_async(self, block: bool = False, stop_when_idle: bool = False) -> SaveResult | None:
        """Advance the save in flight; None while it is not finished on this rank (unless ``block``).

        Writing: collective (every rank, every step) until every rank's writer is done; then the
        commit, replication and retention run on a publisher thread (collectives on the
        replication group), off the training step. Returns the SaveResult once this rank has
        published; raises PublishError if any writer failed or died: the step is not committed
        and its temporary directory is gone, older steps are intact.
        """
        entry = self._inflight
        if entry is not None:
            write = entry["write"]
            outcome, status = self._writer_status(entry, block)
            statuses = self.coll.all_gather(status)
            stalled = next((f"rank {r}: {e}" for r, e in enumerate(statuses) if e.startswith(STALLED)), None)
            if stalled is not None:
                self._inflight = None
                if status.startswith(STALLED):
                    raise self._stalled(entry["step"], status, write)
                shutil.rmtree(entry["tmp"], ignore_errors=True)  # this rank's storage answers
                raise PublishError(f"step {entry['step']} is not complete in tier 1: {stalled}")
            if "running" in statuses:
                if not block:
                    return None
                raise AssertionError("a blocking poll cannot see a running writer")  # pragma: no cover
            self._inflight = None
            error = None if status == "ok" else status
            peer = next((f"rank {r}: {e}" for r, e in enumerate(statuses) if e != "ok"), None)
            digest = outcome.digest if outcome is not None else None
            blocked = entry["blocked"] + (write.snapshot_wait_seconds if write is not None else 0.0)
            host_copy = entry.get("host_copy") or (write.snapshot if write is not None else None)
            args = (entry["step"], entry["tmp"], entry.get("manifest"), error, entry["t0"], blocked, digest)
            self._publishing = PublishInFlight(
                entry["step"],
                lambda: self._publish(*args, coll=self.replicator.coll, peer_error=peer),
                host_copy,
                entry["t0"],
            )
        job = self._publishing
        if job is None or not self._publish_ended(job, block):
            return None
        self._publishing = None
        result = job.result()  # raises the PublishError of a failed save
        self.storage.saved(time.perf_counter() - job.t0)
        if self._keep_host_copy and job.host_copy is not None:
            HOST_COPIES[(self.run_id, self.rank)] = (job.step, job.host_copy)
        return result

    def _writer_status(self, entry: dict[str, Any], block: bool) -> tuple[Any, str]:
        """This rank's writer: its outcome (None while it runs) and its status for the other ranks:
        ``running``, ``ok``, the error, or ``stalled: ...`` once it ran past the stall deadline."""
        write = entry["write"]
        if write is None:
            return None, entry["error"] or "ok"
        deadline = self.storage.deadline()
        outcome = write.poll(block, timeout=max(0.0, deadline - (time.perf_counter() - entry["t0"])))
        if outcome is not None:
            return outcome, entry["error"] or outcome.error or "ok"
        if block or time.perf_counter() - entry["t0"] > deadline:
            return None, f"{STALLED}: the write of {write.path} did not finish within {deadline:.1f}s"
        return None, "running"

    def _publish_ended(self, job: PublishInFlight, block: bool) -> bool:
        """Whether the background publish of ``job`` ended (``block``: wait for it, up to the
        stall deadline). Past the deadline it is abandoned (a daemon thread nothing joins) and the
        tier marked stalled: PublishError."""
        deadline = self.storage.deadline()
        if block:
            job.wait(max(0.0, deadline - (time.perf_counter() - job.t0)))
        if job.done():
            return True
        if not block and time.perf_counter() - job.t0 <= deadline:
            return False
        self._publishing = None
        what = f"{STALLED}: the commit and replication of step {job.step} did not finish within {deadline:.1f}s"
        raise self._stalled(job.step, what)

    def before_optimizer_step(self) -> float:
        """The optimizer is about to change the weights in place: a thread writer still copying
        them must finish first. Returns the seconds training waited (counted as blocked)."""
        entry = self._inflight
        if entry is None or entry["write"] is None:
            return 0.0
        return entry["write"].wait_for_snapshot()

    def poll_fits_in_step(self) -> bool:
        return True  # a status exchange: the commit and replication run on a publisher thread

    def abandon_async(self) -> None:
        """Leaving without publishing (an exception unwinds the loop): stop a fork writer; give
        a publish in flight the replication timeout to end (a lost peer fails it sooner)."""
        if self._inflight is not None and self._inflight["write"] is not None:
            self._inflight["write"].kill(wait_s=min(5.0, self.storage.deadline()))
        self._inflight = None
        if self._publishing is not None:
            self._publishing.wait(min(self.cfg.checkpoint.replication.timeout_s, self.storage.deadline()))
        self._publishing = None

    def finish_publishing(self) -> None:
        """Wait until a background publish is over: before a synchronous save (the same
        replication group; retention) or before moving steps out of the stores. Its outcome
        stays for :meth:`poll_async` to hand to the trainer, which reports it. A publish that
        does not end within the stall deadline marks the tier stalled (poll_async reports it)."""
        job = self._publishing
        if job is not None:
            job.wait(max(0.0, self.storage.deadline() - (time.perf_counter() - job.t0)))
            if not job.done():
                deadline = self.storage.deadline()
                self.storage.stalled(
                    f"{STALLED}: the commit and replication of step {job.step} did not finish within {deadline:.1f}s"
                )

    def _async_mode(self) -> str:
        mode = self.cfg.checkpoint.async_.mode
        if mode != "auto":
            return mode
        # auto is fork on CPU: a write stuck in a stalled file system (uninterruptible in the
        # kernel) is then its own process, which never keeps the rank from exiting; a thread stuck
        # there would (docs/checkpoints.md, "Stalled storage"). Measured cost: 27 ms blocked per
        # 305 MB save vs 3.8 ms for thread, the same training time per save within noise (bench:
        # fork 0.89 s [0.52-1.20], thread 1.14 s [0.89-1.17]). Thread where a process must not
        # fork (CUDA initialised) and where in-process restarts keep the writer's copy as the host copy.
        return "thread" if torch.cuda.is_initialized() or self._keep_host_copy else "fork"


class PublishInFlight:
    """A background save's commit, replication and retention, on its own thread."""

    def __init__(self, step: int, publish: Any, host_copy: dict[str, Any] | None, t0: float) -> None:
        self.step = step
        self.host_copy = host_copy
        self.t0 = t0  # time.perf_counter() the save started (its deadline counts from there)
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(publish,), name=f"publish-{step}", daemon=True)
        self._thread.start()

    def _run(self, publish: Any) -> None:
        try:
            self._result = publish()
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread by result()
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None) -> None:
        self._thread.join(timeout)

    def result(self) -> SaveResult:
        self._thread.join()
        if self._error is not None:
            if isinstance(self._error, PublishError):
                raise self._error
            if isinstance(self._error, (TieringError, OSError)):
                raise PublishError(f"step {self.step} not published: {one_line(self._error)}") from self._error
            raise self._error  # a programming error fails the attempt, never reads as a failed save
        assert self._result is not None
        return self._result

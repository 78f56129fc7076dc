"""Every way the project breaks itself on purpose, for drills and tests: one module, one place.

All faults are configured under ``fault_tolerance.inject`` and, unless ``every_attempt`` is set,
fire on the launcher's first attempt only (a restart must be able to get past them):

* ``kill_rank``/``kill_node`` + ``kill_at_step``: SIGKILL a rank (or every rank of a node);
* ``hang_rank`` + ``hang_at_step`` (``hang_native``): stop making progress, in Python or in C;
* ``raise_at_step`` (``raise_rank``): a user-code exception, deterministic on every rank or transient;
* ``kill_during_replication_rank`` + ``kill_at_step``: SIGKILL a rank while it receives a replica;
* ``writer_fault`` (fail, hang, slow, bug) at ``writer_fault_at_step`` on ``writer_fault_rank``: the
  background tier-1 writer fails (I/O), never finishes, is slow, or raises a programming error;
  ``staging_writer_fault`` (hang) does the same to the reshardable tier's forked writer;
* ``slow_save_at_step`` + ``slow_save_seconds``: a slow filesystem inside the checkpointing section;
* ``poison_restored_step``: a step that verifies but holds a NaN weight after every restore;
* ``hold_at`` + ``hold_seconds``: ranks stay in a phase of an attempt so that a fault injected
  from outside the job (``pretrain drill``, tests) lands inside it;
* ``trigger_dir``: faults raised inside a rank on request from outside the job (``pretrain soak``):
  a file ``rank-N`` in that directory, read at the start of a step, names an exception or a thread
  that takes the GIL and never gives it back (a deadlock). These leave no ``fault_injected`` event:
  the next attempt must diagnose them from their real evidence;
* ``s3_fault``: the uploader's S3 client is SIGKILLed after N multipart parts or sees N part
  timeouts (applied by ``tiering.remote.objectstore`` through ``pretrain upload``; tiering stays standalone).

Each fault that fires leaves a ``fault_injected`` event (except the S3 and phase ones, whose
evidence is the uploader's exit and the phase record) so that attempt records can tell an injected
failure from a real one.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pretrain.config import FaultInjectionConfig
from pretrain.resilience.phases import parse_holds
from pretrain.resilience.restarts import first_attempt, launcher_restart_count

log = logging.getLogger(__name__)

RecordEvent = Callable[..., None]  # RunLog.event


def maybe_inject_fault(
    inj: FaultInjectionConfig, rank: int, step: int, record: RecordEvent, node: str | None = None
) -> None:
    """At the start of ``step``: the configured exception, SIGKILL or hang of this rank."""
    if inj.trigger_dir is not None:
        _maybe_triggered_fault(Path(inj.trigger_dir), rank, step)
    chosen = inj.kill_rank == rank or (inj.kill_node is not None and inj.kill_node == node)
    first = first_attempt() or inj.every_attempt
    if inj.raise_at_step == step and (inj.raise_rank < 0 or (inj.raise_rank == rank and first)):
        if inj.raise_rank >= 0:
            record("fault_injected", force=True, rank=rank, step=step, signal="exception", node=node)
        raise RuntimeError(f"injected user-code error at step {step}")
    if chosen and inj.kill_at_step == step and first:
        record("fault_injected", force=True, rank=rank, step=step, signal="SIGKILL", node=node)
        log.warning("fault injection: rank %d SIGKILLs itself at step %d", rank, step)
        os.kill(os.getpid(), signal.SIGKILL)
    if inj.hang_rank == rank and inj.hang_at_step == step and first:
        record("fault_injected", force=True, rank=rank, step=step, signal="hang", node=node)
        log.warning("fault injection: rank %d hangs at step %d (no more heartbeats)", rank, step)
        if inj.hang_native:  # stuck in C: no Python code runs until a signal kills the process
            ctypes.CDLL(None).pause()
        while True:  # a hang: alive, silent, holding its peers in the next collective
            time.sleep(3600)


def _maybe_triggered_fault(trigger_dir: Path, rank: int, step: int) -> None:
    """The fault a file ``<trigger_dir>/rank-N`` asks for ("exception ID" or "gil ID"), once."""
    path = trigger_dir / f"rank-{rank}"
    try:
        request = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:  # the common case: one stat per step
        return
    path.unlink(missing_ok=True)
    kind, _, ident = request.partition(" ")
    log.warning("fault injection: rank %d was asked for %r at step %d", rank, request, step)
    if kind == "exception":
        # The id makes each one distinct: two in a row are two faults, not a bug repeating itself.
        raise RuntimeError(f"exception {ident} raised on request from outside at step {step}")
    if kind == "gil":
        threading.Thread(target=hold_gil_forever, name="gil-holder", daemon=True).start()
        time.sleep(1.0)  # hands the GIL over; the main thread never gets it back
        return
    raise ValueError(f"{path}: unknown fault request {request!r}; fix: write 'exception ID' or 'gil ID'")


def hold_gil_forever() -> None:
    libc = ctypes.PyDLL(None)  # PyDLL keeps the GIL across the foreign call (CDLL releases it)
    while True:
        libc.pause()


def maybe_die_while_receiving(
    inj: FaultInjectionConfig, rank: int, owner: int, step: int, record: RecordEvent | None
) -> None:
    """SIGKILL this rank while it receives ``owner``'s replica of ``step`` (first attempt only)."""
    if inj.kill_during_replication_rank != rank or inj.kill_at_step != step or launcher_restart_count() != 0:
        return
    if record is not None:
        record("fault_injected", force=True, rank=rank, step=step, signal="SIGKILL", during="replication", owner=owner)
    log.warning("fault injection: rank %d SIGKILLs itself while receiving rank %d's step %d", rank, owner, step)
    os.kill(os.getpid(), signal.SIGKILL)


def _writer_faulted(inj: FaultInjectionConfig, rank: int, step: int) -> bool:
    return inj.writer_fault_at_step == step and inj.writer_fault_rank == rank


def writer_fault(inj: FaultInjectionConfig, rank: int, step: int) -> str | None:
    """The fault the background tier-1 writer of ``step`` on ``rank`` must simulate, if any."""
    return inj.writer_fault if _writer_faulted(inj, rank, step) else None


def staging_writer_fault(inj: FaultInjectionConfig, rank: int, step: int) -> str | None:
    """The fault the reshardable tier's forked writer of ``step`` on ``rank`` must simulate, if any."""
    return inj.staging_writer_fault if _writer_faulted(inj, rank, step) else None


def hanging_writer(*args: object, **kwargs: object) -> None:
    """Stands in for a forked writer's function: never writes, never returns (killed from outside)."""
    del args, kwargs
    while True:
        time.sleep(3600)


def maybe_slow_save(inj: FaultInjectionConfig, step: int) -> None:
    if inj.slow_save_at_step == step and inj.slow_save_seconds > 0:
        log.warning("fault injection: the save of step %d takes %.1f s longer", step, inj.slow_save_seconds)
        time.sleep(inj.slow_save_seconds)


def maybe_poison_restored(inj: FaultInjectionConfig, restored_step: int, model: torch.nn.Module) -> None:
    """A checkpoint that verifies but is poisoned (a NaN weight), every time it is restored."""
    if inj.poison_restored_step != restored_step:
        return
    log.warning("fault injection: step %d restored with a NaN weight", restored_step)
    with torch.no_grad():
        next(p for p in model.parameters() if p.numel() > 0).view(-1)[0] = float("nan")


def phase_hold(inj: FaultInjectionConfig) -> Callable[[str], None]:
    """What a rank does on entering a phase: hold ``hold_seconds`` where ``hold_at`` names it."""
    holds, seconds = parse_holds(inj.hold_at), inj.hold_seconds

    def hold(phase: str) -> None:
        if seconds > 0 and (launcher_restart_count(), phase) in holds:
            log.warning("fault injection: holding %.1f s in phase %s", seconds, phase)
            time.sleep(seconds)

    return hold

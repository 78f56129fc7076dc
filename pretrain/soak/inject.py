"""Faults injected into a live job from outside it: signals by PID, trigger files, a flipped byte.

Owns the mapping from a fault kind (``pretrain.soak.schedule.KINDS``) to what is done to the job's
processes and files, and nothing else: when to inject and what the records say afterwards belong to
``pretrain.soak.runner`` and ``pretrain.soak.report``. The in-rank kinds (an exception, a thread
holding the GIL) go through the trainer's own hook: a file ``rank-N`` in
``fault_tolerance.inject.trigger_dir`` that the rank reads at the start of its next step
(``pretrain.resilience.faults``). Job-level kinds (the launcher killed, a preemption) are carried out
here up to the launcher's exit; starting the job again is the runner's (as Slurm's requeue would).
The storage kinds act on tier 1's file system, not on a process (:mod:`pretrain.soak.storage`):
``blocked-write`` closes the gated mount's gate, ``full-disk`` fills its tmpfs. The store kind
``s3-unreachable`` black-holes the proxy between the uploader and the object store
(:mod:`pretrain.soak.store_proxy`). :func:`release` undoes those once the fault was recorded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from pretrain.soak.storage import StorageFaults
from pretrain.soak.store_proxy import StoreProxy
from tiering.system.fsio import atomic_write_bytes

STEP_GLOB = "step-*"


@dataclass
class LiveRanks:
    """The ranks of the attempt being hit, from their phase records: pid and host by rank."""

    attempt: str
    pids: dict[int, int]
    hosts: dict[int, str]

    def on_host_of(self, rank: int) -> list[int]:
        return sorted(r for r, h in self.hosts.items() if h == self.hosts[rank])


@dataclass
class Injected:
    """What was done: when, to which ranks and processes, and anything kind-specific."""

    time: float
    ranks: list[int]
    pids: list[int]
    detail: dict[str, Any] = field(default_factory=dict)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def kill_tree(proc: subprocess.Popen[bytes]) -> list[int]:
    """SIGKILL a launcher and every process under it at once (a node or job lost): nothing gets to
    clean up. Returns the pids killed."""
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    return [p.pid for p in tree]


def newest_committed(rank_dir: Path) -> Path | None:
    steps = sorted(p for p in (rank_dir / "steps").glob(STEP_GLOB) if (p / "COMMITTED").exists())
    return steps[-1] if steps else None


def flip_byte_in_newest(local_root: Path, rank: int) -> dict[str, Any]:
    """Flip one byte in the middle of the largest data file of ``rank``'s newest committed tier-1 step."""
    step = newest_committed(local_root / "ranks" / f"rank-{rank:05d}")
    if step is None:
        return {"flipped": None}
    files = [p for p in step.rglob("*") if p.is_file() and p.name not in ("COMMITTED", "manifest.json")]
    target = max(files, key=lambda p: p.stat().st_size)
    with open(target, "r+b") as f:  # in place, as storage rots: same file, same size, one byte wrong
        f.seek(target.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return {"flipped": str(target), "step": int(step.name.split("-")[1])}


def inject(
    kind: str,
    rank: int,
    live: LiveRanks,
    launcher: subprocess.Popen[bytes],
    trigger_dir: Path,
    local_root: Path,
    index: int,
    now: float,
    storage: StorageFaults | None = None,
    proxy: StoreProxy | None = None,
) -> Injected:
    """Do fault ``kind`` to ``rank`` of the live attempt (or to its node, the whole job, tier 1's
    storage, which ``storage`` holds for the storage kinds, or the object store behind ``proxy``)."""
    if kind in ("blocked-write", "full-disk"):
        return _storage_fault(kind, live, storage, now)
    if kind == "s3-unreachable":
        if proxy is None:
            raise ValueError(f"fault kind {kind!r} needs the soak's store proxy")  # the runner sets it up
        held = proxy.black_hole()
        return Injected(now, [], [], {"endpoint": proxy.upstream, "proxy": proxy.url, "held_connections": held})
    one = [live.pids[rank]]
    if kind == "kill-rank":
        _signal(one, signal.SIGKILL)
        return Injected(now, [rank], one)
    if kind == "kill-node":
        ranks = live.on_host_of(rank)
        pids = [live.pids[r] for r in ranks]
        _signal(pids, signal.SIGKILL)
        return Injected(now, ranks, pids, {"host": live.hosts[rank]})
    if kind == "kill-job":
        return Injected(now, sorted(live.pids), kill_tree(launcher), {"launcher": launcher.pid})
    if kind == "sigstop":
        _signal(one, signal.SIGSTOP)  # never continued: the launcher must find and kill it
        return Injected(now, [rank], one)
    if kind == "sigsegv":
        _signal(one, signal.SIGSEGV)
        return Injected(now, [rank], one)
    if kind in ("exception", "gil"):
        trigger_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(trigger_dir / f"rank-{rank}", f"{kind} {index}".encode())
        return Injected(now, [rank], one)
    if kind == "corrupt-kill":
        flipped = flip_byte_in_newest(local_root, rank)
        _signal(one, signal.SIGKILL)
        return Injected(now, [rank], one, flipped)
    if kind == "sigterm":
        launcher.send_signal(signal.SIGTERM)  # as Kubernetes and Slurm stop a job: the launcher first
        return Injected(now, sorted(live.pids), [launcher.pid], {"launcher": launcher.pid})
    raise ValueError(f"unknown fault kind {kind!r}")  # schedule.parse_kinds refuses these first


def _storage_fault(kind: str, live: LiveRanks, storage: StorageFaults | None, now: float) -> Injected:
    if storage is None or storage.mount is None or storage.volume is None:
        raise ValueError(f"fault kind {kind!r} needs tier 1 on the soak's storage mount")  # the runner sets it up
    if kind == "blocked-write":
        storage.mount.close()
        return Injected(now, sorted(live.pids), [], {"gate": str(storage.mount.gate)})
    filled = storage.volume.fill()
    return Injected(now, sorted(live.pids), [], {"filled_bytes": filled})


def release(kind: str, storage: StorageFaults | None, proxy: StoreProxy | None = None) -> dict[str, Any]:
    """Undo a storage or store fault (the gate opened, the filling file deleted, the store answering
    again); nothing for other kinds. Returns what was done."""
    if kind == "s3-unreachable" and proxy is not None:
        return {"reset_connections": proxy.answer()}
    if storage is None or storage.mount is None or storage.volume is None:
        return {}
    if kind == "blocked-write":
        storage.mount.open()
    elif kind == "full-disk":
        storage.volume.free()
    return {}

"""The standby server: imports everything a rank imports, then forks one rank per request on the
listening socket it was given (clients that came during the imports wait in its backlog).

It stays single-threaded, so a fork copies no lock held by another thread; it refuses to serve
(and exits, so clients run their ranks themselves) if the imports started a thread or initialised
CUDA, which a forked child cannot use. NVML, which torch's NVML-based CUDA check initialises and
never shuts down, is shut down before the first fork: the server and every rank would otherwise
hold ``/dev/nvidiactl`` and ``/dev/nvidia*`` open for the job's life (in the way of a GPU reset or
a MIG change by node remediation). It reaps its children through pidfds and reports each wait
status to the client that asked for it. It watches each client too: when one ends, its rank's
process group is SIGKILLed from here, because the rank's own watcher is a thread that cannot run
while the rank is stopped (SIGSTOP) or a thread holds its GIL (the rank keeps that watcher for when
this process is gone). It ends with its parent (``PR_SET_PDEATHSIG``, set by :mod:`.beside`);
ranks already forked live on until their clients end.

A rank that was killed (the rank monitor's SIGKILL on a hang, the end of its group) or that exited
while one of its threads waits in the kernel on storage that does not answer (an NFS or Lustre
server gone, uninterruptibly) cannot end until the storage answers, and its launcher would wait for
it: no restart, no progress. Such a rank's kill is pending in ``/proc`` while a thread of it sleeps
uninterruptibly; once that has lasted ``HELD_S`` its client is told the status it will end with
(SIGKILL, or the exit code it left with) and the launcher restarts the job; the rank is reaped,
silently, when the kernel lets it go.

Run by :mod:`.beside`: ``python -m pretrain.resilience.standby.server FD``, FD a listening socket.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pretrain.platform.import_collector import imports_without_collecting
from pretrain.platform.procfs import EXIT_CODE, STATE, stat_fields
from pretrain.resilience.standby import wire
from pretrain.resilience.standby.wire import RankRequest

# The rank program's own imports (pretrain.cli pulls in torch, Megatron and NVRx), and the modules
# a rank imports later, during its first save and restore (measured: sys.modules at the end of a
# tiny training run against sys.modules after importing pretrain.train).
PRELOAD = (
    "pretrain.cli",
    "pretrain.train",
    "pretrain.resilience.standby.rank_entry",
    "nvidia_resiliency_ext.fault_tolerance",
    "nvidia_resiliency_ext.attribution.straggler",  # NVRx >= 0.7 (pretrain.platform.compat)
    "nvidia_resiliency_ext.straggler",  # NVRx 0.4-0.6
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader",
    "multiprocessing.popen_fork",
    "multiprocessing.popen_spawn_posix",
    "torch.utils.serialization",
    # torch.optim's first optimizer imports Dynamo (its methods are wrapped by ``_disable_dynamo``,
    # which imports ``torch._dynamo`` at the first call): 0.7 s of every forked rank's build, the
    # largest part of a restart. Imported here, before the first fork, though it makes the job's
    # start wait longer for this process: once here costs less CPU than once in every rank (soak,
    # two job-level faults: 5.5 and 6.4 s from the fault to the next step with it here, 6.3 and
    # 6.8 s with it imported by the server only after its first forks).
    "torch._dynamo",
)

GROUP_GRACE_S = 5.0  # torch elastic's default before it SIGKILLs a worker group that ignored SIGTERM
# A kill pending this long while a thread sleeps uninterruptibly: the kernel holds the rank (a write
# to storage that stalls). Longer than any exit: a rank freeing its memory is not held.
HELD_S = 2.0
HELD_CHECK_S = 0.5  # how often live ranks are looked at for that
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)  # in /proc's pending-signal masks


def preload() -> int:
    """Import what ranks import; the number of modules loaded. A module that is missing here (no
    NVRx straggler package, say) is skipped: the rank would fail on it the same way either way.
    ``torch.compile`` is made lazy first, as ``pretrain train`` does before Megatron's imports, so
    forked ranks inherit lazily wrapped functions; Dynamo itself is preloaded last, because the
    optimizer a rank builds imports it anyway (no thread is started by that import)."""
    importlib.import_module("pretrain.platform.lazy_compile").defer_torch_compile()
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            print(f"standby: not preloading {name}: {exc}", file=sys.stderr)
    return len(sys.modules)


CUDA_ERROR_NOT_INITIALIZED = 3


def cuda_driver_loaded(maps: str) -> bool:
    """Whether ``maps`` (``/proc/self/maps``) shows the CUDA driver library loaded (libcuda.so.1,
    libcuda.so.550.54.15; never libcudart). Loaded is not initialised: Triton's autotuner (>= 3.2)
    loads it at import through its ``cuda_utils`` module, and a fork is still safe then."""
    return "/libcuda.so" in maps


def cuda_driver_initialised() -> bool:
    """With the driver library mapped: whether ``cuInit`` ran in this process. ``cuDeviceGetCount``
    answers CUDA_ERROR_NOT_INITIALIZED before ``cuInit`` and initialises nothing; RTLD_NOLOAD takes
    the library already mapped and never loads one. ``torch.cuda.is_initialized()`` cannot tell:
    ``torch.cuda.is_available()`` may run ``cuInit`` without it turning True."""
    driver = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
    count = ctypes.c_int()
    return driver.cuDeviceGetCount(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED


NVML_SUCCESS = 0
NVML_MAX_SHUTDOWNS = 64  # more nvmlInit calls than one process's imports make (torch's checks, pynvml users)


def nvml_library(maps: str | None = None) -> Any | None:
    """NVML as this process mapped it (torch's NVML-based CUDA check, pynvml), or None; never loads it."""
    if "/libnvidia-ml.so" not in (Path("/proc/self/maps").read_text() if maps is None else maps):
        return None
    try:
        return ctypes.CDLL("libnvidia-ml.so.1", mode=os.RTLD_NOLOAD)
    except OSError:  # mapped under another name: not the one torch and pynvml open
        return None


def shut_nvml_down(library: Any | None) -> int:
    """Shut NVML down in this process: every ``nvmlInit`` counts a reference and ``nvmlShutdown``
    drops one (NVML closes its device files at the last); called until NVML answers that it is not
    initialised. Returns the references dropped (0 without NVML)."""
    if library is None:
        return 0
    for dropped in range(NVML_MAX_SHUTDOWNS):
        if library.nvmlShutdown() != NVML_SUCCESS:
            return dropped
    return NVML_MAX_SHUTDOWNS


def open_device_files(prefix: str = "/dev/nvidia") -> list[str]:
    """The files under ``prefix`` this process holds open (what a forked rank would inherit)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(prefix):
                held.append(target)
    return sorted(held)


def fork_hazard(
    maps: str | None = None, driver_initialised: Callable[[], bool] = cuda_driver_initialised
) -> str | None:
    """Why forking this process would hand ranks a broken copy, if it would. Python threads are
    counted, not ``/proc/self/task``: importing torch starts a native thread of its own (measured:
    2 tasks, 1 Python thread), which takes no lock a forked rank needs and forks never met trouble with."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised by an import (a forked child cannot use it)"
    if cuda_driver_loaded(Path("/proc/self/maps").read_text() if maps is None else maps) and driver_initialised():
        return "the CUDA driver was initialised by an import (cuInit: a forked child could not use CUDA)"
    threads = threading.active_count()
    if threads > 1:
        return f"the imports started {threads - 1} thread(s) (a fork would copy their locks held)"
    return None


class Server:
    """The accept-and-fork loop. ``serve`` returns only in a forked child, with its request."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ)
        self.children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, its client's connection)
        self.clients: dict[int, int] = {}  # a client's pidfd -> the pid of the rank it asked for
        self.groups: dict[int, float] = {}  # process group of an ended rank -> when to SIGKILL what is left
        self.held: dict[int, float] = {}  # a rank's pidfd -> since when its kill has been pending
        self.told: set[int] = set()  # pidfds of held ranks whose clients were told their status

    def serve(self) -> RankRequest:
        while True:
            self._kill_overdue_groups()
            self._report_held_ranks()
            wake = [*self.groups.values(), *([time.monotonic() + HELD_CHECK_S] if self.children else [])]
            timeout = min(wake, default=None)
            ready = self.selector.select(None if timeout is None else max(0.0, timeout - time.monotonic()))
            # One event per select: handling it may close descriptors the rest of the batch names
            # (a rank reaped drops its client's watch), and a number closed may be reused at once by
            # the next accept; whatever else was ready is returned again by the next select.
            for key, _ in ready[:1]:
                if key.fileobj is self.listener:
                    request = self._accept()
                    if request is not None:
                        return request
                elif key.fd in self.clients:
                    self._client_ended(key.fd)
                else:
                    self._reap(key.fd)

    def _accept(self) -> RankRequest | None:
        conn, _ = self.listener.accept()
        fds: list[int] = []
        try:
            wire.require_same_user(conn)
            conn.settimeout(wire.REQUEST_TIMEOUT_S)  # a silent client costs its connection, not the server
            message, fds = wire.receive(conn, wire.STDIO_AND_PIDFD)
            request = None if message is None else wire.parse_request(message, fds)
        except (OSError, ValueError) as exc:  # a stranger, a client gone or silent, a malformed request
            print(f"standby: dropped a connection: {exc}", file=sys.stderr)
            request = None
        if request is None:
            wire.close_all(fds)
            conn.close()
            return None
        pid = os.fork()
        if pid == 0:
            self._become_child(conn)
            return request
        for fd in fds[:3]:
            os.close(fd)
        self.clients[fds[3]] = pid
        self.selector.register(fds[3], selectors.EVENT_READ)
        with contextlib.suppress(OSError):  # a client gone already: the watch above ends its rank
            wire.send(conn, {"pid": pid})
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = (pid, conn)
        self.selector.register(pidfd, selectors.EVENT_READ)
        return None

    def _reap(self, pidfd: int) -> None:
        pid, conn = self.children.pop(pidfd)
        _, status = os.waitpid(pid, 0)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        self.held.pop(pidfd, None)
        # Its pid is free for reuse from here on: stop watching its client, whose end would kill it.
        for client_pidfd in [c for c, rank in self.clients.items() if rank == pid]:
            del self.clients[client_pidfd]
            self.selector.unregister(client_pidfd)
            os.close(client_pidfd)
        if pidfd in self.told:  # its client was told while the kernel held the rank
            self.told.discard(pidfd)
        else:
            with contextlib.suppress(OSError):  # the client is gone (killed with its launcher): nobody to tell
                wire.send(conn, {"status": status})
        conn.close()
        # What the rank started (Megatron's writer processes, the multiprocessing resource tracker)
        # is in the rank's process group, not in the launcher's worker group: end it as the
        # launcher would have, SIGTERM now and SIGKILL after a grace period.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
            self.groups[pid] = time.monotonic() + GROUP_GRACE_S

    def _client_ended(self, client_pidfd: int) -> None:
        """The launcher killed (or lost) the client: its rank ends now, as it would have with the
        client, even if it is stopped or wedged. The rank leads its own group after ``setsid``; a
        rank forked a moment ago may not have called it yet, so the pid is killed as well."""
        pid = self.clients.pop(client_pidfd)
        self.selector.unregister(client_pidfd)
        os.close(client_pidfd)
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(pid, signal.SIGKILL)

    def _report_held_ranks(self) -> None:
        """Tell the client of each rank the kernel has held for ``HELD_S`` after its kill how it will
        end (see the module docstring); it is reaped later, as any rank."""
        now = time.monotonic()
        for pidfd, (pid, conn) in list(self.children.items()):
            status = None if pidfd in self.told else held_status(pid)
            if status is None:
                self.held.pop(pidfd, None)
                continue
            if now - self.held.setdefault(pidfd, now) < HELD_S:
                continue
            print(
                f"standby: rank process {pid} ended but the kernel holds it (a thread waits on storage that "
                "does not answer?): its launcher is told it ended; it is reaped once the kernel lets it go",
                file=sys.stderr,
            )
            with contextlib.suppress(OSError):  # the client is gone already
                wire.send(conn, {"status": status})
            self.told.add(pidfd)

    def _kill_overdue_groups(self) -> None:
        now = time.monotonic()
        for pgid in [g for g, deadline in self.groups.items() if deadline <= now]:
            del self.groups[pgid]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)

    def _become_child(self, conn: socket.socket) -> None:
        """Drop what belongs to the server and to the other ranks: a rank holding another rank's
        connection would hide that connection's end from its client."""
        for pidfd, (_pid, other) in self.children.items():
            other.close()
            os.close(pidfd)
        for client_pidfd in self.clients:
            os.close(client_pidfd)
        self.selector.close()
        self.listener.close()
        conn.close()


def held_status(pid: int) -> int | None:
    """The wait status ``pid`` will end with, if the kernel holds it after its end: a SIGKILL is
    pending (it was killed, or it is exiting while another of its threads has not) and one of its
    threads sleeps uninterruptibly (D: in a write to storage that does not answer). None
    otherwise (a rank that is merely slow to exit, say, freeing its memory), or if it is gone."""
    proc = Path("/proc") / str(pid)
    try:
        tasks = list((proc / "task").iterdir())
        masks = [_pending(proc / "status", "ShdPnd:")] + [_pending(t / "status", "SigPnd:") for t in tasks]
        states = [stat_fields(t / "stat")[STATE] for t in tasks]
        if not any(mask & _SIGKILL_BIT for mask in masks) or "D" not in states:
            return None
        fields = stat_fields(proc / "stat")
    except (OSError, ValueError, StopIteration, IndexError):
        return None
    # A leader that exited already is a zombie holding its exit status; one still in the kernel
    # ends of the pending SIGKILL.
    exited = fields[STATE] == "Z" and len(fields) > EXIT_CODE
    return int(fields[EXIT_CODE]) if exited else signal.SIGKILL


def _pending(status_file: Path, field: str) -> int:
    line = next(line for line in status_file.read_text().splitlines() if line.startswith(field))
    return int(line.split()[1], 16)


def main(argv: list[str]) -> None:
    started = time.monotonic()
    # torch.cuda.is_available() during the imports would otherwise initialise the CUDA driver
    # (poisoning every fork); NVML answers the same question without it. The server's own
    # environment only: each rank gets its client's.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    # Signals for the job (Slurm's --signal and scancel, a terminal's ^C) reach every process of
    # the step, this one too: they are the ranks' to handle. This process ends with its launcher.
    for sig in wire.JOB_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, wire.JOB_SIGNALS)  # blocked by .beside until now: pending ones dropped
    listener = socket.socket(fileno=int(argv[0]))  # bound and listening already (see .beside)
    # The preloaded objects (~350 k) end in the collector's permanent generation: a forked rank's
    # first full collection would otherwise walk them all (0.23 s measured) and write to each
    # object's header, copying the pages it shares with this process (CPython's advice for fork
    # servers: freeze before forking; nothing the serve loop makes later is worth freezing). The
    # collector is also off while they are imported: a second of a new job's start on 2 cores
    # (see imports_without_collecting).
    with imports_without_collecting():
        modules = preload()
    hazard = fork_hazard()
    if hazard is not None:
        print(f"standby: not serving: {hazard}; ranks import everything themselves", file=sys.stderr)
        listener.close()
        return
    dropped = shut_nvml_down(nvml_library())
    held = open_device_files()
    if dropped or held:
        print(f"standby: NVML shut down ({dropped} reference(s)); GPU device files still open: {held}", file=sys.stderr)
    print(
        f"standby: ready in {time.monotonic() - started:.1f} s ({modules} modules); ranks start as forks",
        file=sys.stderr,
    )
    request = Server(listener).serve()
    # Deferred on purpose: it imports torch, which this module leaves to preload() (already
    # loaded by now); a forked rank is the only one that runs it.
    from pretrain.resilience.standby.rank_entry import run

    run(request)


if __name__ == "__main__":
    main(sys.argv[1:])

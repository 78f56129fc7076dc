"""Background writers for tier-1 saves: training pays for a snapshot, not for the write.

* ``thread`` (any device): the writer thread first copies every large tensor into reusable host
  buffers (on GPU a device-to-host copy on its own stream into pinned memory), then writes. The
  copy overlaps the next step's forward and backward, which only read the weights; the trainer
  calls :meth:`BackgroundWrite.wait_for_snapshot` before the optimizer changes them in place.
  Every non-tensor value is copied on the training thread at the save (cheap). On GPU the writer
  thread binds itself to the tensors' device for the copy (a thread starts on cuda:0): its stream,
  the wait for the kernels that produced the state (an event recorded on the training thread's
  stream at the save) and the pinned buffers are all on that device.
* ``fork`` (CPU): ``os.fork()`` is the snapshot. The child sees the parent's memory as it was at
  the fork (copy-on-write), serialises it, fsyncs and exits; the parent goes on training and
  changes its own pages only. Blocked time is the fork itself (page tables, not data), plus the
  copy-on-write faults the next optimizer step takes. On CPU ``tensor.to("cpu")`` copies nothing,
  so a writer that shares memory without a copy would see later updates.

Either way the writer writes ``state.pt`` into the step's temporary directory and computes its
SHA-256 while writing (handed back for the manifest: nothing is read back to be hashed).
Publishing (manifest, rename, ``COMMITTED``) happens on the training thread once every rank's
writer is done, so a step whose writer died or failed is never committed.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import logging
import os
import queue
import select
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from tiering.digest import DEFAULT_HASHING, ChunkedDigest, HashSpec
from tiering.errors import TieringError
from tiering.system.fsio import write_file_durably

log = logging.getLogger(__name__)


# What a writer may meet from the storage: reported as a failed save (training goes on). Anything
# else it raises is a bug, raised on the training thread so that it fails the attempt.
STORAGE_ERRORS = (OSError, TieringError)

# A fork writer's first act is one byte on its pipe. A child that has not sent it this long after
# the fork never ran any of its code: it is deadlocked in the interpreter's after-fork code, on a
# lock another thread held at the fork (CPython gh-112275, fixed in 3.11.10 and 3.12; see
# tiering.system.hash_threads). It is killed and the save fails at once, instead of passing, a stall
# deadline later, for a stalled file system. The child is scheduled within milliseconds even on a
# loaded machine; 10 s leaves room for a host swapping under memory pressure.
FORK_START_S = 10.0
_STARTED = b"+"


class WriterBug(RuntimeError):
    """A fork writer failed with a programming error (its type and message are in the text)."""


def _maybe_bug(fault: str | None) -> None:
    if fault == "bug":  # tests: a programming error inside the save, which must fail the attempt
        raise TypeError("injected programming error in the tier-1 writer")


@dataclass
class WriteOutcome:
    ok: bool
    error: str | None
    seconds: float
    digest: ChunkedDigest | None = None  # of the written file, computed while writing


def killed_by_signal(pid: int, signum: int) -> str:
    """How a background writer process that was killed is reported (both tiers)."""
    return f"background writer (pid {pid}) was killed by signal {signum}"


class SnapshotBuffers:
    """Host buffers reused from one save to the next: one arena per dtype, sized to the state's
    tensors of that dtype (pinned on GPU hosts), each tensor copied into its view. One allocation
    per dtype instead of one per tensor: on a GPU host each pinned allocation is a
    ``cudaHostAlloc`` that the caching host allocator rounds up to a power of two, locked for the
    process's life. :meth:`reserve` allocates them at start-up (out of any step); a save whose
    tensors of a dtype fit in its arena reuses it, whatever the layout (a first step creating
    Adam's moments included, when the reservation counted them)."""

    def __init__(self) -> None:
        self._layout: list[tuple[torch.dtype, torch.Size]] = []
        self._views: list[torch.Tensor] = []
        self.arenas: dict[torch.dtype, torch.Tensor] = {}  # what is allocated, by dtype
        self.allocations = 0  # arenas allocated so far (a dtype outgrowing its arena allocates it again)

    def reserve(self, elements: dict[torch.dtype, int], pin: bool) -> None:
        """Allocate an arena of ``elements[dtype]`` elements per dtype now, unless one that big is held."""
        for dtype, n in elements.items():
            held = self.arenas.get(dtype)
            if held is None or held.numel() < n or held.is_pinned() != pin:
                self.arenas[dtype] = torch.empty(n, dtype=dtype, device="cpu", pin_memory=pin)
                self.allocations += 1

    def views(self, tensors: list[torch.Tensor], pin: bool) -> list[torch.Tensor]:
        """Host views shaped like ``tensors``, in order (an arena reallocated only when outgrown)."""
        layout = [(t.dtype, t.shape) for t in tensors]
        if layout != self._layout:
            self._cut(layout, pin)
        return self._views

    def _cut(self, layout: list[tuple[torch.dtype, torch.Size]], pin: bool) -> None:
        sizes: dict[torch.dtype, int] = {}
        for dtype, shape in layout:
            sizes[dtype] = sizes.get(dtype, 0) + shape.numel()
        self.reserve(sizes, pin)
        self._views = []
        offsets = dict.fromkeys(sizes, 0)
        for dtype, shape in layout:
            start = offsets[dtype]
            offsets[dtype] = start + shape.numel()
            self._views.append(self.arenas[dtype][start : offsets[dtype]].view(shape))
        self._layout = layout


class BackgroundWrite:
    """One save in flight; see the module docstring for what each mode snapshots when."""

    def __init__(
        self,
        mode: str,
        payload: dict[str, Any],
        path: Path,
        fault: str | None = None,
        buffers: SnapshotBuffers | None = None,
        prepare: Callable[[], object] | None = None,
        hashing: HashSpec = DEFAULT_HASHING,
        slow_s: float = 0.6,
    ) -> None:
        """``prepare`` (e.g. creating the step's temporary directory) runs in the writer, before
        the write: file-system metadata calls can stall for long under heavy writeback, and
        that is no reason to hold up training. ``hashing``: the chunked digest computed while
        writing (its thread count bounds the writer's extra CPU). ``slow_s``: the extra seconds
        of a ``slow`` fault (tests: a slow file system)."""
        self.mode = mode
        self.path = path
        self.hashing = hashing
        self.started = time.perf_counter()
        self.start_timeout_s = FORK_START_S
        self._child_ran = False  # fork: its first byte arrived
        self._stuck_at_fork = False  # fork: killed for never starting
        self.snapshot_wait_seconds = 0.0  # what wait_for_snapshot() cost the trainer
        self._pid: int | None = None
        self._report_fd: int | None = None
        self._written: threading.Event | None = None  # thread mode: set when the write ended
        self._thread_error: str | None = None
        self._thread_bug: Exception | None = None
        self._digest: ChunkedDigest | None = None
        self._snapshot_done = threading.Event()
        self._snapshot: dict[str, Any] | None = None
        self._outcome: WriteOutcome | None = None
        self.device: torch.device | None = None  # thread mode: the CUDA device of the saved tensors
        self.copy_binding: dict[str, str] | None = None  # thread mode on GPU: where the copy ran
        if mode == "fork":
            read_fd, write_fd = os.pipe()
            self._pid = _fork_without_collecting()
            if self._pid == 0:  # the child: write, fsync, leave without running any parent cleanup
                os.close(read_fd)
                _child_write(payload, path, fault, write_fd, prepare, hashing, slow_s)
            os.close(write_fd)
            self._report_fd = read_fd
            self._snapshot_done.set()
        else:
            staged, devices = stage_with_devices(payload)
            self.device = snapshot_device(devices)
            produced = record_produced(self.device)
            # Handed over in a box the writer empties: once copied, nothing of this save holds the
            # live (GPU) tensors, not even the queued closure, so a stalled write or an in-process
            # restart never keeps a model's worth of device memory alive.
            box = [staged]
            del staged
            self._written = _WRITER.submit(lambda: self._write_thread(box, buffers, fault, prepare, produced, slow_s))

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def snapshot(self) -> dict[str, Any] | None:
        """The host copy the thread writer made (None for ``fork``, or before it is complete)."""
        return self._snapshot if self._snapshot_done.is_set() else None

    def wait_for_snapshot(self) -> float:
        """Block until the state is copied (``thread``); returns the seconds waited. Call it
        before anything changes the saved tensors in place (the optimizer step)."""
        if self._snapshot_done.is_set():
            return 0.0
        t0 = time.perf_counter()
        self._snapshot_done.wait()
        waited = time.perf_counter() - t0
        self.snapshot_wait_seconds += waited
        return waited

    def _write_thread(
        self,
        box: list[dict[str, Any]],
        buffers: SnapshotBuffers | None,
        fault: str | None,
        prepare: Callable[[], object] | None,
        produced: Any = None,
        slow_s: float = 0.6,
    ) -> None:
        try:
            try:
                self._snapshot, self.copy_binding = copy_tensors(box.pop(), buffers, self.device, produced)
            finally:
                box.clear()
                self._snapshot_done.set()  # never leave the trainer waiting, even on failure
            if prepare is not None:
                prepare()
            if fault == "slow":
                time.sleep(slow_s)
            _maybe_bug(fault)
            self._digest = write_file_durably(self.path, lambda fh: save_state(self._snapshot, fh), self.hashing)
            if fault == "fail":
                raise OSError("injected writer failure")
        except STORAGE_ERRORS as exc:  # the storage said no: reported by poll(), the step is not committed
            self._thread_error = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # a bug: poll() raises it on the training thread, failing the attempt
            self._thread_bug = exc

    def poll(self, block: bool = False, timeout: float | None = None) -> WriteOutcome | None:
        """None while running; the outcome once the writer ended (cause included on failure).
        ``block`` waits for the end, for at most ``timeout`` seconds when given (then None)."""
        if self._outcome is not None:
            return self._outcome
        if self._pid is not None:
            pid, status = self._wait_child(block, timeout)
            if pid == 0:
                return None
            error = None
            report = _read_report(self._report_fd)
            self._close_pipe()
            if report.get("bug"):
                raise WriterBug(f"background writer (pid {self._pid}) raised {report.get('error')}")
            if self._stuck_at_fork:
                error = (
                    f"background writer (pid {self._pid}) never started: {self.start_timeout_s:.0f}s after the fork "
                    "it had run none of its code (deadlocked in the interpreter's after-fork code, CPython gh-112275); "
                    "killed, the step is not committed and the next save forks again; fix: Python >= 3.11.10"
                )
            elif os.WIFSIGNALED(status):
                error = killed_by_signal(self._pid, os.WTERMSIG(status))
            elif os.WEXITSTATUS(status) != 0:
                detail = report.get("error", "no detail")
                error = f"background writer (pid {self._pid}) exited {os.WEXITSTATUS(status)}: {detail}"
            else:
                self._digest = report.get("digest")
        else:
            assert self._written is not None
            if not self._written.wait(timeout if block else 0):
                return None
            if self._thread_bug is not None:
                raise self._thread_bug
            error = self._thread_error
        self._outcome = WriteOutcome(error is None, error, time.perf_counter() - self.started, self._digest)
        return self._outcome

    def _wait_child(self, block: bool, timeout: float | None) -> tuple[int, int]:
        """``waitpid`` of the writer (``(0, 0)`` while it runs); a child that never started is
        killed and reaped here, whether or not the caller blocks."""
        assert self._pid is not None
        end = None if timeout is None else time.monotonic() + timeout
        while (found := os.waitpid(self._pid, os.WNOHANG))[0] == 0:
            if self._never_started():
                self._stuck_at_fork = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._pid, signal.SIGKILL)
                return os.waitpid(self._pid, 0)  # a futex wait, not the kernel's: SIGKILL ends it
            if not block or (end is not None and time.monotonic() >= end):
                break
            time.sleep(0.01)
        return found

    def _never_started(self) -> bool:
        """Whether the child sent nothing ``start_timeout_s`` after the fork (reads its first byte)."""
        if self._child_ran or self._report_fd is None:
            return False
        if select.select([self._report_fd], [], [], 0)[0]:
            os.read(self._report_fd, 1)  # its start byte, or the end of the pipe: either way it ran
            self._child_ran = True
            return False
        return time.perf_counter() - self.started > self.start_timeout_s

    def kill(self, wait_s: float | None = None) -> None:
        """Stop a fork writer that is no longer wanted (its step will not be committed). A writer
        stuck in the kernel (a stalled file system) survives SIGKILL until the storage answers:
        with ``wait_s`` it is waited for at most that long, then left behind (its own process:
        it never keeps this one from exiting)."""
        if self._pid is not None and self._outcome is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, 9)
            if self.poll(block=True, timeout=wait_s) is None:
                log.warning("background writer (pid %d) is stuck in the kernel; left behind", self._pid)
                self._close_pipe()

    def abandon(self) -> None:
        """Give up on this write without waiting (its tier's storage stalled). A fork writer is
        killed (and left behind if the kernel holds it); a thread writer cannot be stopped: the
        thread is left to its write and later saves get a new writer thread."""
        if self._pid is not None:
            self.kill(wait_s=0.2)
        elif self._written is not None and not self._written.is_set():
            _WRITER.replace()

    def _close_pipe(self) -> None:
        if self._report_fd is not None:
            os.close(self._report_fd)
            self._report_fd = None


class WriterThread:
    """One long-lived daemon thread that runs thread-mode writes in order: starting a thread per
    save cost the training thread 1-4 ms (``Thread.start`` waits for the new thread to run, which
    waits for the GIL), a fifth of the whole blocked time of a 300 MB save."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], object], threading.Event]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def replace(self) -> None:
        """The thread is stuck in a write that will not return soon: later work gets a new thread
        and queue (the old thread ends after its write; it is a daemon, nothing joins it)."""
        with self._lock:
            self._queue = queue.SimpleQueue()
            self._thread = None

    def submit(self, work: Callable[[], object]) -> threading.Event:
        done = threading.Event()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, args=(self._queue,), name="ckpt-writer", daemon=True)
                self._thread.start()  # once per process (and after a stalled write)
            self._queue.put((work, done))
        return done

    @staticmethod
    def _loop(work_queue: queue.SimpleQueue[tuple[Callable[[], object], threading.Event]]) -> None:
        while True:
            work, done = work_queue.get()
            try:
                work()
            finally:
                done.set()


_WRITER = WriterThread()


def stage_on_training_thread(payload: Any) -> Any:
    """Public name of the staging every background writer does (tier 0 writes what it returns)."""
    return _stage_on_training_thread(payload)


def stage_with_devices(payload: Any) -> tuple[Any, set[torch.device]]:
    """:func:`stage_on_training_thread` and the devices of the payload's tensors, in one walk (a
    rank's payload is ~1,200 values and tier 0 stages one every step on the training thread)."""
    devices: set[torch.device] = set()
    return _stage_on_training_thread(payload, devices), devices


_PLAIN = (int, float, str, bool, bytes, type(None))


def _stage_on_training_thread(payload: Any, devices: set[torch.device] | None = None) -> Any:
    """Rebuild the containers and copy every non-tensor value now (the scheduler, counters and
    RNG states move on before the writer runs); tensors stay references for the writer thread to
    copy before the next optimizer step, the only thing that changes them in place. ``devices``:
    gets the device of every tensor."""
    if isinstance(payload, torch.Tensor):
        if devices is not None:
            devices.add(payload.device)
        return payload
    if isinstance(payload, dict):
        return {k: _stage_on_training_thread(v, devices) for k, v in payload.items()}
    kind = type(payload)
    if kind in (list, tuple):
        if all(type(v) in _PLAIN for v in payload):  # a long list of numbers (an RNG state): as it is
            return payload if kind is tuple else list(payload)
        return kind(_stage_on_training_thread(v, devices) for v in payload)
    if isinstance(payload, _PLAIN):
        return payload
    return copy.deepcopy(payload)


def snapshot_device(devices: Any) -> torch.device | None:
    """The CUDA device the writer thread binds to for a snapshot of tensors on ``devices``: None
    when none is on CUDA. One rank's state lives on one GPU: tensors on two are a programming
    error, refused rather than copied on the wrong device's stream."""
    cuda = {torch.device(d) for d in devices if torch.device(d).type == "cuda"}
    if len(cuda) > 1:
        raise ValueError(f"a snapshot's tensors are on {sorted(map(str, cuda))}: one rank's state must be on one GPU")
    if not cuda:
        return None
    device = cuda.pop()
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def tensor_devices(v: Any) -> set[torch.device]:
    if isinstance(v, torch.Tensor):
        return {v.device}
    if isinstance(v, dict):
        return set().union(*(tensor_devices(x) for x in v.values()))
    if type(v) in (list, tuple):
        return set().union(*(tensor_devices(x) for x in v))
    return set()


def record_produced(device: torch.device | None) -> Any:
    """On the training thread, at the save: an event after the kernels queued so far on its
    current stream of ``device`` (the optimizer step that produced the state)."""
    if device is None:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


@dataclass(frozen=True)
class _At:
    """Where a tensor stood in a staged tree (its position in the flat list being copied)."""

    index: int


def copy_tensors(
    staged: Any, buffers: SnapshotBuffers | None, device: torch.device | None = None, produced: Any = None
) -> tuple[dict[str, Any], dict[str, str] | None]:
    """The writer thread's snapshot: every tensor copied into host memory (into the reusable
    arenas when given; on GPU on a side stream of the tensors' device, after ``produced``, into
    pinned arenas, the thread bound to that device), the rest as staged. Also returns where a GPU
    copy ran. Tier 1's thread writer and tier 0 on GPU both snapshot through it."""
    tensors: list[torch.Tensor] = []

    def collect(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return _At(len(tensors) - 1)
        if isinstance(v, dict):
            return {k: collect(x) for k, x in v.items()}
        if type(v) in (list, tuple):
            return type(v)(collect(x) for x in v)
        return v

    shape = collect(staged)
    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
        stream = torch.cuda.Stream(device=device) if device is not None else None
        if stream is not None and produced is not None:
            stream.wait_event(produced)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if buffers is not None:
                host = buffers.views(tensors, pin=device is not None)
                for view, tensor in zip(host, tensors, strict=True):
                    view.copy_(tensor.detach(), non_blocking=stream is not None)
            else:
                host = [t.detach().to("cpu", copy=True, non_blocking=stream is not None) for t in tensors]
        binding = None
        if stream is not None:
            stream.synchronize()
            binding = {
                "tensors": str(device),
                "thread": f"cuda:{torch.cuda.current_device()}",
                "stream": str(stream.device),
            }
    tensors.clear()

    def rebuild(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: rebuild(x) for k, x in v.items()}
        if type(v) in (list, tuple):
            return type(v)(rebuild(x) for x in v)
        return host[v.index] if isinstance(v, _At) else v

    return rebuild(shape), binding


def save_state(payload: dict[str, Any], fh: IO[bytes]) -> None:
    """``torch.save`` without its per-record CRC-32: the chunked digest computed while writing
    covers every byte already, and the CRC cost ~10 % of a save's time (2.4 GB/s on one core)."""
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(payload, fh)
    finally:
        torch.serialization.set_crc32_options(previous)


def _read_report(fd: int | None) -> dict[str, Any]:
    """What the fork writer reported through its pipe: ``digest`` or ``error``."""
    if fd is None:
        return {}
    raw = b""
    while chunk := os.read(fd, 65536):
        raw += chunk
    raw = raw.removeprefix(_STARTED)  # unless the parent's poll read it already
    try:
        report = json.loads(raw)
    except ValueError:
        return {}  # nothing (killed): the caller has the signal
    if "digest" in report:
        report["digest"] = ChunkedDigest.from_json(report["digest"])
    return report


def _fork_without_collecting() -> int:
    """``os.fork()`` with the cyclic garbage collector off in the child for its whole life.

    The child is a copy of a process that runs other threads (tier 0's writer, hash lanes,
    libraries' pools) and holds their garbage. A collection in the child would finalize the
    parent's objects in a process where their threads and locks do not exist: the full suite saw
    a writer child die of SIGSEGV while garbage-collecting (with pyarrow loaded in the process).
    The child lives for one write and leaves with ``os._exit``, so it has no use for a collector;
    it is off from before the fork, so no collection runs even in the interpreter's after-fork
    hooks, and turned off again in the child in case another thread of the parent turned it back
    on in between (Megatron's and DCP's save helpers toggle the process-wide flag). The parent's
    collector state is restored at once."""
    enabled = gc.isenabled()
    gc.disable()
    pid = -1
    try:
        pid = os.fork()
    finally:
        if pid == 0:
            gc.disable()
        elif enabled:  # the parent, or a fork that failed
            gc.enable()
    return pid


def _child_write(
    payload: dict[str, Any],
    path: Path,
    fault: str | None,
    report_fd: int,
    prepare: Callable[[], object] | None,
    hashing: HashSpec,
    slow_s: float,
) -> None:
    code = 0
    report: dict[str, Any] = {}
    try:
        if fault == "stuck-at-fork":  # tests: a child that never runs its code (see FORK_START_S)
            time.sleep(3600)
        os.write(report_fd, _STARTED)
        if fault == "hang":  # tests: a writer that never finishes (killed from outside)
            time.sleep(3600)
        if fault == "slow":  # tests: a slow filesystem
            time.sleep(slow_s)
        if prepare is not None:
            prepare()
        _maybe_bug(fault)
        report["digest"] = write_file_durably(path, lambda fh: save_state(payload, fh), hashing).to_json()
        if fault == "fail":
            raise OSError("injected writer failure")
    except BaseException as exc:  # noqa: BLE001 - the child must always reach os._exit
        code = 1
        report = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=2)}
        report["bug"] = not isinstance(exc, STORAGE_ERRORS)  # the parent raises it instead of reporting it
    with contextlib.suppress(OSError):
        os.write(report_fd, json.dumps(report).encode())
    os._exit(code)

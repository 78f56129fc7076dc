"""Background writers for tier-1 saves: training pays for a snapshot, not for the write.

* ``fork`` (CPU): ``os.fork()`` is the snapshot. The child sees the parent's memory as it was at
  the fork (copy-on-write), serialises it, fsyncs and exits; the parent goes on training and
  changes its own pages only. Blocked time is the fork itself (page tables, not data). On CPU
  ``tensor.to("cpu")`` copies nothing, so a writer that shares memory would see later updates.
* ``thread`` (any device): an explicit snapshot (a copy into host memory; on GPU the device-to-host
  copy) is written by a thread. Blocked time is the copy.

Either way the writer only *writes* ``state.pt`` into the step's temporary directory. Publishing
(manifest, rename, ``COMMITTED``) happens on the training thread once every rank's writer is done,
so a step whose writer died or failed is never committed and its temporary directory is removed.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

ERROR_FILE = ".write-error"


@dataclass
class WriteOutcome:
    ok: bool
    error: str | None
    seconds: float


class BackgroundWrite:
    """One save in flight: the payload is already snapshotted when the constructor returns."""

    def __init__(self, mode: str, payload: dict[str, Any], path: Path, fault: str | None = None) -> None:
        self.mode = mode
        self.path = path
        self.started = time.perf_counter()
        self.blocked_seconds = 0.0
        self._pid: int | None = None
        self._thread: threading.Thread | None = None
        self._thread_error: str | None = None
        self._outcome: WriteOutcome | None = None
        t0 = time.perf_counter()
        if mode == "fork":
            self._pid = os.fork()
            if self._pid == 0:  # the child: write, fsync, leave without running any parent cleanup
                _child_write(payload, path, fault)
        else:
            snapshot = _snapshot(payload)
            self._thread = threading.Thread(
                target=self._write_thread, args=(snapshot,), name="ckpt-writer", daemon=True
            )
            self._thread.start()
        self.blocked_seconds = time.perf_counter() - t0

    @property
    def pid(self) -> int | None:
        return self._pid

    def _write_thread(self, snapshot: dict[str, Any]) -> None:
        try:
            _write_durably(snapshot, self.path)
        except Exception as exc:  # reported by poll(); the step is not committed
            self._thread_error = f"{type(exc).__name__}: {exc}"

    def poll(self, block: bool = False) -> WriteOutcome | None:
        """None while running; the outcome once the writer ended (cause included on failure)."""
        if self._outcome is not None:
            return self._outcome
        if self._pid is not None:
            pid, status = os.waitpid(self._pid, 0 if block else os.WNOHANG)
            if pid == 0:
                return None
            error = None
            if os.WIFSIGNALED(status):
                error = f"background writer (pid {self._pid}) was killed by signal {os.WTERMSIG(status)}"
            elif os.WEXITSTATUS(status) != 0:
                err_file = self.path.parent / ERROR_FILE
                detail = err_file.read_text().strip() if err_file.exists() else "no detail"
                error = f"background writer (pid {self._pid}) exited {os.WEXITSTATUS(status)}: {detail}"
        else:
            assert self._thread is not None
            self._thread.join(None if block else 0)
            if self._thread.is_alive():
                return None
            error = self._thread_error
        self._outcome = WriteOutcome(error is None, error, time.perf_counter() - self.started)
        return self._outcome

    def kill(self) -> None:
        """Stop a fork writer that is no longer wanted (its step will not be committed)."""
        if self._pid is not None and self._outcome is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, 9)
            self.poll(block=True)


def _snapshot(payload: dict[str, Any]) -> dict[str, Any]:
    """Host copy of every tensor (device-to-host on GPU; an explicit clone on CPU)."""

    def copy_tensor(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", copy=True)

    return torch.utils._pytree.tree_map(
        lambda v: copy_tensor(v) if isinstance(v, torch.Tensor) else copy.copy(v), payload
    )


def _write_durably(payload: dict[str, Any], path: Path) -> None:
    with open(path, "wb") as fh:
        torch.save(payload, fh)
        fh.flush()
        os.fsync(fh.fileno())
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _child_write(payload: dict[str, Any], path: Path, fault: str | None) -> None:
    code = 0
    try:
        if fault == "hang":  # tests: a writer that never finishes (killed from outside)
            time.sleep(3600)
        if fault == "slow":  # tests: a slow filesystem
            time.sleep(0.6)
        _write_durably(payload, path)
        if fault == "fail":
            raise OSError("injected writer failure")
    except BaseException as exc:  # noqa: BLE001 - the child must always reach os._exit
        code = 1
        with contextlib.suppress(OSError):
            (path.parent / ERROR_FILE).write_text(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=2)}")
    os._exit(code)

"""Pins: a step in use by a process (an upload, a restore) that retention must not delete, held by
a process on any node of the shared volume.

A pin is a file ``pins/step-N.<holder>.<random>`` holding its holder's identity (the boot id and
PID namespace of the process, and its pid) and a lease: the holder renews the file's mtime every
quarter of ``ttl_s`` from a daemon thread until it releases the pin. A reader decides whether a pin
is still held:

* every holder: the lease has not run out (mtime within ``ttl_s``, plus the tolerance of clocks a few
  seconds apart), so a pid reused by another process never keeps a pin;
* a holder in the reader's own PID namespace on the same boot: besides, its pid is alive (a killed
  holder's pin is dead at once); elsewhere (another node, another pod's PID namespace) a pid means
  nothing here and only the lease counts.

A pin whose holder is dead is removed by the reader. Never: trusts a pid across PID namespaces or
hosts (an uploader that is PID 1 of its pod would look alive forever, or dead at once), or deletes a
pin whose lease still runs. Used by :class:`tiering.local.posix.PosixTier`.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path

from tiering.layout import parse_step_name, step_name

DEFAULT_TTL_S = 120.0  # an upload of a large step takes minutes: the lease is renewed, not sized to it


def process_identity() -> dict[str, str | int]:
    """What tells this process apart from a process of the same pid elsewhere."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown"
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = "unknown"
    return {"boot": boot, "pid_ns": pid_ns, "pid": os.getpid()}


class StepPin:
    """A pin held by this process, renewed until :meth:`release` (or the end of a ``with``)."""

    def __init__(self, pins_dir: Path, step: int, holder: str, ttl_s: float = DEFAULT_TTL_S) -> None:
        pins_dir.mkdir(parents=True, exist_ok=True)
        self.path = pins_dir / f"{step_name(step)}.{holder}.{uuid.uuid4().hex[:12]}"
        self.path.write_text(json.dumps({**process_identity(), "ttl_s": ttl_s}))
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, args=(ttl_s / 4,), name="pin-renew", daemon=True)
        self._renewer.start()

    def _renew(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                os.utime(self.path)
            except FileNotFoundError:  # removed by someone who judged it dead: nothing to renew
                return

    def release(self) -> None:
        self._stop.set()
        self._renewer.join()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> StepPin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def held_steps(pins_dir: Path, clock_skew_s: float = 10.0) -> set[int]:
    """Steps with a pin still held (see the module docstring); dead pins are removed."""
    out: set[int] = set()
    if not pins_dir.is_dir():
        return out
    me = process_identity()
    for path in pins_dir.iterdir():
        step = parse_step_name(path.name.split(".")[0])
        if step is None:
            continue
        if _held(path, me, clock_skew_s):
            out.add(step)
        else:
            path.unlink(missing_ok=True)
    return out


def _held(path: Path, me: dict[str, str | int], clock_skew_s: float) -> bool:
    try:
        age = time.time() - path.stat().st_mtime
        body = json.loads(path.read_text())
    except FileNotFoundError:
        return False
    except (ValueError, UnicodeDecodeError):  # a pin of an older version, or one being written
        body = {}
    ttl = float(body.get("ttl_s", DEFAULT_TTL_S)) if isinstance(body, dict) else DEFAULT_TTL_S
    lease_runs = age <= ttl + clock_skew_s
    if isinstance(body, dict) and body.get("boot") == me["boot"] and body.get("pid_ns") == me["pid_ns"]:
        try:
            os.kill(int(body["pid"]), 0)
        except ProcessLookupError:
            return False  # its holder is gone: no need to wait for the lease
        except PermissionError:  # another user's live process
            pass
    return lease_runs  # a live holder renews it; a pid reused by another process does not

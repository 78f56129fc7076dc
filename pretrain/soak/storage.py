"""Storage faults for the soak (and the tests): tier 1 on file systems that can stall or fill up.

Owns mounting, faulting and unmounting; never decides when (``pretrain.soak.runner``) or what the
records must say (``pretrain.soak.report``). As root:

* :class:`GatedMount`: the FUSE passthrough of ``pretrain/soak/gated_fs.py`` (run as its own process from
  the repository: the file system is test code, not part of the library) whose data writes block
  in the kernel while its gate file exists, as a hung NFS/Lustre server's do. ``close()`` and
  ``open()`` the gate; ``stop()`` opens it (every blocked writer returns), unmounts and waits.
* :class:`SmallVolume`: a tmpfs of a given size, filled from outside (``fill()``: one file that
  takes every free byte) and freed (``free()``).
* :class:`StorageFaults`: both under the soak's tier-1 directory: the gated mount over a small
  tmpfs, so that one directory can stall (``blocked-write``) and fill up (``full-disk``).

Every object here is stopped by its owner in a ``finally``, whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FILL_NAME = ".soak-fill"


def fuse_missing() -> str | None:
    """Why a gated FUSE mount cannot be made here, or None."""
    if os.geteuid() != 0:
        return "mounting needs root"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    try:
        import fuse  # noqa: F401 - only whether fusepy is installed
    except (ImportError, OSError) as exc:
        return f"fusepy cannot load ({exc}; pip install -e '.[test]', libfuse2)"
    return None


class GatedMount:
    """The gated FUSE passthrough of ``backing`` at ``mountpoint`` (see the module docstring)."""

    def __init__(self, backing: Path, mountpoint: Path, gate: Path, log: Path) -> None:
        self.backing, self.mountpoint, self.gate = backing, mountpoint, gate
        backing.mkdir(parents=True, exist_ok=True)
        mountpoint.mkdir(parents=True, exist_ok=True)
        self.open()
        self.log = log  # the daemon's output: a line "holding write to PATH" per write it holds
        self._log = log.open("ab")
        cmd = [sys.executable, "-m", "pretrain.soak.gated_fs", str(backing), str(mountpoint), str(gate)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while not os.path.ismount(mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"gated FUSE mount at {mountpoint} did not come up; see {log}")
            time.sleep(0.05)

    def close(self, only: tuple[str, ...] = ()) -> None:
        """Every data write blocks from now on; with ``only`` (parts starting with a dot), writes
        to files whose paths contain one. Written whole, then renamed into place."""
        tmp = self.gate.with_name(self.gate.name + ".new")
        tmp.write_text("".join(f"{part}\n" for part in only))
        tmp.replace(self.gate)

    def open(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.gate.unlink()

    def stop(self) -> None:
        self.open()  # every blocked writer returns first
        if os.path.ismount(self.mountpoint):
            subprocess.run(["umount", "-l", str(self.mountpoint)], check=False, capture_output=True)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()


class SmallVolume:
    """A tmpfs of ``size_mb`` at ``where``, filled and freed from outside."""

    def __init__(self, where: Path, size_mb: int) -> None:
        self.where = where
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(where)], check=True)

    def fill(self) -> int:
        """Take every free byte with one file; returns the bytes written."""
        written = 0
        chunk = b"\0" * (1 << 20)
        with contextlib.suppress(OSError), open(self.where / FILL_NAME, "ab") as f:
            while True:
                written += f.write(chunk)
                f.flush()
        return written

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.where / FILL_NAME).unlink()

    def stop(self) -> None:
        if os.path.ismount(self.where):
            subprocess.run(["umount", "-l", str(self.where)], check=False, capture_output=True)


class StorageFaults:
    """Tier 1 at ``mountpoint``: the gated mount over a small tmpfs (see the module docstring)."""

    def __init__(self, root: Path, mountpoint: Path, size_mb: int) -> None:
        self.volume: SmallVolume | None = None
        self.mount: GatedMount | None = None
        try:
            self.volume = SmallVolume(root / "tier1-volume", size_mb)
            self.mount = GatedMount(self.volume.where, mountpoint, root / "tier1-gate", root / "tier1-fuse.log")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.mount is not None:
            self.mount.stop()
        if self.volume is not None:
            self.volume.stop()
            shutil.rmtree(self.volume.where, ignore_errors=True)

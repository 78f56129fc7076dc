"""A FUSE passthrough filesystem whose writes block while its gate is closed: the stalled storage of
the soak's ``blocked-write`` kind and of the tests (a deliberate fault, like the others in ``pretrain/soak``).

``python -m pretrain.soak.gated_fs BACKING MOUNTPOINT GATE`` mounts ``BACKING`` at ``MOUNTPOINT`` (fusepy over
libfuse2, foreground, multithreaded). Every call that writes data (write, fsync, truncate)
first waits while the file ``GATE`` exists (if it lists name parts starting with a dot, ``.distcp``,
one per line, only writes to files whose paths contain one wait: a stall that catches a background
writer's big files while the small ones written beside them still answer); lookups, metadata
changes (create, mkdir, rename, unlink) and reads always answer. (Gating metadata too would hold
the parent directory's lock in the kernel, so even listing the directory from the test would
hang.) A process writing there while the gate is closed is stuck in the kernel as a real stalled
NFS/Lustre write is (uninterruptible once the request reached this daemon: SIGKILL does not free
it) until the gate file is removed.

:class:`pretrain.soak.storage.GatedMount` starts and stops this daemon (tests and the soak's
``blocked-write`` kind). It needs fusepy (the ``test`` extra); the soak refuses the kind in one line without it.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from typing import Any

from fuse import FUSE, FuseOSError, Operations


class GatedPassthrough(Operations):
    def __init__(self, root: str, gate: str) -> None:
        self.root = root
        self.gate = gate

    def _full(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def _wait_gate(self, path: str) -> None:
        if not self._closed_for(path):
            return
        # The request is this daemon's now: the writer waits uninterruptibly once a signal comes.
        print(f"holding write to {path}", file=sys.stderr, flush=True)
        while self._closed_for(path):
            time.sleep(0.05)

    def _closed_for(self, path: str) -> bool:
        try:
            with open(self.gate) as fh:
                only = [line.strip() for line in fh if line.startswith(".")]
        except FileNotFoundError:
            return False
        return not only or any(part in path for part in only)

    def __call__(self, op: str, *args: Any) -> Any:
        if not hasattr(self, op):
            raise FuseOSError(errno.EFAULT)
        try:
            return getattr(self, op)(*args)
        except OSError as exc:
            raise FuseOSError(exc.errno or errno.EIO) from exc

    # -- read side: always answers ----------------------------------------------------------------
    def access(self, path: str, mode: int) -> None:
        if not os.access(self._full(path), mode):
            raise FuseOSError(errno.EACCES)

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        st = os.lstat(self._full(path))
        keys = ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink", "st_size", "st_uid")
        return {k: getattr(st, k) for k in keys}

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._full(path))]

    def readlink(self, path: str) -> str:
        return os.readlink(self._full(path))

    def statfs(self, path: str) -> dict[str, Any]:
        st = os.statvfs(self._full(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag", "f_frsize")
        return {k: getattr(st, k) for k in keys} | {"f_namemax": st.f_namemax}

    def open(self, path: str, flags: int) -> int:
        return os.open(self._full(path), flags)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return os.pread(fh, size, offset)

    def release(self, path: str, fh: int) -> None:
        os.close(fh)

    def flush(self, path: str, fh: int) -> None:
        return None

    # -- write side: data waits while the gate is closed -----------------------------------------------
    def create(self, path: str, mode: int, fi: Any = None) -> int:
        return os.open(self._full(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        self._wait_gate(path)
        return os.pwrite(fh, data, offset)

    def truncate(self, path: str, length: int, fh: int | None = None) -> None:
        self._wait_gate(path)
        os.truncate(self._full(path), length)

    def fsync(self, path: str, datasync: int, fh: int) -> None:
        self._wait_gate(path)
        os.fsync(fh)

    def fsyncdir(self, path: str, datasync: int, fh: int) -> None:
        return None

    def mkdir(self, path: str, mode: int) -> None:
        os.mkdir(self._full(path), mode)

    def rmdir(self, path: str) -> None:
        os.rmdir(self._full(path))

    def unlink(self, path: str) -> None:
        os.unlink(self._full(path))

    def rename(self, old: str, new: str) -> None:
        os.rename(self._full(old), self._full(new))

    def chmod(self, path: str, mode: int) -> None:
        os.chmod(self._full(path), mode)

    def chown(self, path: str, uid: int, gid: int) -> None:
        os.chown(self._full(path), uid, gid)

    def utimens(self, path: str, times: tuple[float, float] | None = None) -> None:
        os.utime(self._full(path), times)

    def symlink(self, target: str, source: str) -> None:
        os.symlink(source, self._full(target))


def main() -> None:
    backing, mountpoint, gate = sys.argv[1:4]
    ops = GatedPassthrough(os.path.abspath(backing), os.path.abspath(gate))
    # hard_remove: unlinking a file that is still open removes it, as on a local filesystem, instead
    # of libfuse's rename to .fuse_hiddenNNN (which made deleting its directory fail, ENOTEMPTY).
    # big_writes: data comes in requests of up to 128 KiB (the kernel's cap), not 4 KiB pages, as an
    # NFS or Lustre client's do. With 4 KiB pages a 64 MB write took 3.7-5.8 s of this Python daemon on
    # a 2-core machine at load 20 (0.5-1.1 s with big writes), and tier-1 saves under the suite's
    # load passed the soak's 8 s stall deadline: false stalls after a full-disk fault, until the job
    # ended without tier 1 coming back.
    FUSE(ops, mountpoint, foreground=True, nothreads=False, hard_remove=True, big_writes=True)


if __name__ == "__main__":
    main()

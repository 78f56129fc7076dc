"""Private node-local directories: the per-run roots of tier 0 (tmpfs) and tier 1 (NVMe), which
hold full model and optimizer shards and must be neither readable by other users nor replaceable
by them.

Owns :func:`private_dir`: the directory is created with mode 0700 (its missing parents too), or,
when it exists already, checked without following a symlink (``O_NOFOLLOW|O_DIRECTORY``, then
``fstat``): it must be a directory owned by this user; group/other bits are taken away from one of
ours. A symlink, a file, or a directory another user owns (a squatter who created it first) is
refused with :class:`tiering.errors.UnsafeDirectory`: one line naming the path and the fix. Its
parent must not let another user replace it: owned by this user or root, or not writable by
others, or sticky (``/dev/shm``, ``/tmp``).

Never: deletes or moves anything it refuses (the squatter's data stays for the admin to see),
follows a symlink at the checked directory, or decides where a tier lives (its caller does:
:mod:`pretrain.checkpointing.per_rank`, :mod:`pretrain.checkpointing.memory_tier`).
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from tiering.errors import UnsafeDirectory


def private_dir(path: Path) -> Path:
    """``path`` as a 0700 directory of this user (created if absent); raises UnsafeDirectory."""
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_parent(path.parent)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        kind = "a symlink" if os.path.islink(path) else "not a directory"
        raise UnsafeDirectory(
            f"{path}: {kind} where a private directory belongs; fix: remove it, or choose another directory"
        ) from exc
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise UnsafeDirectory(
                f"{path}: owned by uid {st.st_uid}, not {os.getuid()} (another user created it first); "
                "fix: have it removed, or choose a directory of your own"
            )
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


def _check_parent(parent: Path) -> None:
    st = os.stat(parent)
    mine = st.st_uid in (os.getuid(), 0)
    if not mine and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise UnsafeDirectory(
            f"{parent}: owned by uid {st.st_uid} and writable by others, who may replace what is in it; "
            "fix: choose a directory of your own (e.g. /dev/shm/resilient-pretrain-$USER)"
        )

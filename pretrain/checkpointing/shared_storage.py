"""Shared storage checked at start: every rank must see what rank 0 writes in the reshardable tier.

The reshardable tier (``checkpoint.reshardable.dir``, also the S3 tier's staging area) is written
by every rank and published by rank 0, so it must be one filesystem seen by every node. When it is
node-local (an sbatch pointed at node scratch, a pod whose volume is mounted wrong) nothing fails
until the first reshardable save, hours in, and then at every restart. Here, before the first step:
rank 0 writes a probe file unique to this attempt under ``<dir>/<run.id>/``, every rank looks for
it (for ``wait_s`` seconds, for filesystems that show new files late), the ranks gather what they
saw, and if any rank cannot see it every rank raises :class:`~pretrain.errors.ConfigError`, one
line naming the first such rank, its node, the path and the fix. A ConfigError is a user error
(:mod:`pretrain.resilience.failures`): the repeat-stop policy ends the job instead of looping.

Owns only its probe files (rank 0 removes its own after the check, and older ones left by killed
attempts); never touches checkpoints. Called by :func:`pretrain.session.build_session` before the
data, the model and the tiers are built.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path

from pretrain.errors import ConfigError
from tiering.collective import Collective

PROBE_PREFIX = ".shared-probe-"
KEY = "checkpoint.reshardable.dir"
# Permission and path problems are the user's to fix; a full or failing disk stays an OSError
# (an infrastructure failure that a restart elsewhere may not repeat).
_USER_ERRNOS = (errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST, errno.ENAMETOOLONG)


def probe_path(run_root: Path, attempt: str) -> Path:
    """Unique per attempt: a name no node has looked up before, so no cached "absent" answer
    (NFS negative lookups) can hide it."""
    return run_root / f"{PROBE_PREFIX}{attempt}"


def _write_probe(path: Path, body: str, node: str) -> tuple[int, str] | None:
    """Rank 0: the probe written and fsynced, older probes removed; (errno, one line) if not."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for old in path.parent.glob(f"{PROBE_PREFIX}*"):
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
        with open(path, "w", encoding="utf-8") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        return exc.errno or 0, (
            f"{KEY}: rank 0 on node {node} cannot write {path} ({exc.strerror}); "
            f"fix: make {path.parent} writable by uid {os.getuid()} on every node"
        )
    return None


def _sees_probe(path: Path, body: str, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if path.read_text(encoding="utf-8") == body:
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def check_shared(run_root: Path, attempt: str, coll: Collective, node: str, wait_s: float = 10.0) -> None:
    """Collective. Raise ConfigError on every rank unless every rank sees rank 0's probe under
    ``run_root`` (``<checkpoint.reshardable.dir>/<run.id>`` as this rank resolves it)."""
    path = probe_path(run_root, attempt)
    body = ""
    error = None
    if coll.rank == 0:
        body = f"attempt {attempt} written by rank 0 on node {node} at {time.time():.3f}\n"
        error = _write_probe(path, body, node)
    error, body = coll.broadcast((error, body))  # also the barrier: the probe exists from here on
    if error is not None:
        code, line = error
        if code in _USER_ERRNOS:
            raise ConfigError(line)
        raise OSError(code, line)
    # Each rank reports its own view: the same path string names another directory on a node
    # whose storage is local.
    seen = coll.all_gather((_sees_probe(path, body, wait_s), node, str(run_root)))
    if coll.rank == 0:
        with contextlib.suppress(OSError):
            path.unlink()
    blind = [(rank, where, root) for rank, (ok, where, root) in enumerate(seen) if not ok]
    if not blind:
        return
    rank, where, root = blind[0]
    others = f" (and {len(blind) - 1} more ranks)" if len(blind) > 1 else ""
    # The same words at every attempt (no probe name): the repeat-stop policy matches failures by text.
    raise ConfigError(
        f"{KEY}: rank {rank} on node {where}{others} cannot see the probe file that rank 0 on node "
        f"{seen[0][1]} wrote in {root}: the directory is not shared by every node; fix: mount one shared "
        f"filesystem at {Path(root).parent} on every node (or point {KEY} at one)"
    )

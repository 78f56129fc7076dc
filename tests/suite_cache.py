"""What a session fixture builds, built once per test run instead of once per xdist worker.

A session fixture runs in every worker that needs it: with ``make test``'s workers the shared
40-step reference job and the corpus were built twice, each a full job's CPU on a 2-core machine.
:func:`built_once` builds into the directory all workers of one run share (the parent of each
worker's base temporary directory; a run without xdist uses its own), under a lock: the first
worker to ask builds, the others wait for it and read the same files. The product is marked done
only once its build returned, so a build that failed (or a worker killed in the middle) leaves a
directory the next asker empties and builds again, and no one reads a half-built product.
"""

from __future__ import annotations

import fcntl
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

DONE = ".built"


class BaseTemp(Protocol):
    """What is read of pytest's ``TempPathFactory``: the worker's base temporary directory."""

    def getbasetemp(self) -> Path: ...


def shared_root(factory: BaseTemp) -> Path:
    """The directory every worker of this run shares: xdist gives each worker ``popen-gwN`` under it."""
    base = factory.getbasetemp()
    return base.parent if base.name.startswith("popen-gw") else base


def built_once(factory: BaseTemp, name: str, build: Callable[[Path], None]) -> Path:
    """``<shared root>/<name>``, filled by ``build(path)`` in the first worker that asks, waited for by
    the others (a build of a tiny training job takes well under a minute)."""
    root = shared_root(factory)
    path = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this worker dies
        if not (path / DONE).exists():
            shutil.rmtree(path, ignore_errors=True)  # what a failed or killed build left
            path.mkdir()
            build(path)
            (path / DONE).touch()
    return path

"""What a session fixture builds, built once per test run instead of once per xdist worker.

A session fixture runs in every worker that needs it: with ``make test``'s workers the shared
40-step reference job and the corpus were built twice, each a full job's CPU on a 2-core machine.
:func:`built_once` builds into the directory all workers of one run share (the parent of each
worker's base temporary directory; a run without xdist uses its own), under a lock: the first
worker to ask builds, the others wait for it and read the same files. The product is marked done
only once its build returned, so no one reads a half-built product. A build that failed leaves
its error beside the product, and every later asker fails at once with it (one failing build per
run, not one per worker in turn behind the lock); a worker killed in the middle of a build leaves
neither mark, and the next asker empties the directory and builds again.
"""

from __future__ import annotations

import fcntl
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

DONE = ".built"
FAILED = ".failed"


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
    failed = root / f"{name}{FAILED}"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this worker dies
        if failed.exists():
            raise RuntimeError(f"{name}: another worker's build of it failed in this run: {failed.read_text()}")
        if not (path / DONE).exists():
            shutil.rmtree(path, ignore_errors=True)  # what a killed build left
            path.mkdir(exist_ok=True)  # a process of that build may still have been writing in it
            try:
                build(path)
            except BaseException as exc:
                failed.write_text(f"{type(exc).__name__}: {str(exc)[-2000:]}")
                raise
            (path / DONE).touch()
    return path

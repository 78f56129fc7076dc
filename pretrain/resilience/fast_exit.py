"""A failed rank under a launcher leaves at once, once its failure is recorded.

After an attempt failed (its record and failure report written by
:func:`pretrain.resilience.attempt_guard.fail_attempt`), nothing the interpreter's teardown does is
needed: the group restarts from a checkpoint. That teardown (atexit handlers, joining threads,
freeing a model's modules) took 1.1-1.7 s per rank on the tiny CPU config, measured between the
process group's destruction and the launcher seeing the exit; the peers learnt of the failure only
when the failing rank finally closed its connections, and the launcher restarts only once it saw
an exit. :func:`leave_now` prints the traceback as the interpreter would, flushes the logs and
the standard streams, and ends the process with ``os._exit``: the kernel closes its sockets (the
peers' collectives fail at once) and the launcher sees the exit at its next poll.

It also serves the ways out that are ``SystemExit`` but end an attempt early (a preemption's
emergency save published, a straggler excluded), with their exit codes.

Never: used without a launcher (``TORCHELASTIC_RUN_ID`` unset: a test or a caller in the same
process gets the exception), under NVRx's in-process restart (the exception is what restarts it),
or when the run trained to its end.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import traceback
from collections.abc import Callable


def under_launcher() -> bool:
    """Whether this process is a rank a torchelastic launcher (torchrun, ft_launcher) started."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def exit_code(exc: BaseException) -> int:
    """The status the interpreter would have exited with for ``exc``."""
    if isinstance(exc, SystemExit):
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 1


def leave_now(exc: BaseException, before: Callable[[], object] | None = None) -> None:
    """Run ``before`` (what must not be cut short: a writer's start-up), end the process's
    multiprocessing children (a writer's Manager would otherwise outlive it: the interpreter's exit
    handler that stops them is skipped), print ``exc`` as an uncaught exception would be, flush,
    and end the process (never returns)."""
    try:
        if before is not None:
            before()
        for child in multiprocessing.active_children():
            child.kill()
        if not isinstance(exc, SystemExit):
            traceback.print_exception(exc, file=sys.stderr)
        logging.shutdown()  # flushes every handler (the rank's log lines before the traceback)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(exit_code(exc))

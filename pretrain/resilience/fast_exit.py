"""A failed rank under a launcher leaves at once, once its failure is recorded.

After an attempt failed (its record and failure report written by
:func:`pretrain.resilience.attempt_guard.fail_attempt`), nothing the interpreter's teardown does is
needed: the group restarts from a checkpoint. That teardown (atexit handlers, joining threads,
freeing a model's modules) took 1.1-1.7 s per rank on the tiny CPU config, measured between the
process group's destruction and the launcher seeing the exit, and the launcher restarts only once
it saw an exit. :func:`leave_now` ends the process as the command would have (the one line of an
error the user needs one line for and its status, else the traceback as the interpreter prints
it), flushes the logs and the standard streams, ends the process's multiprocessing children and
calls ``os._exit``: the launcher sees the exit at its next poll. ``pretrain train``
(:mod:`pretrain.cli`) calls it for every way out of ``train()`` but a return, the ``SystemExit``
ones included (a preemption's emergency save published, a straggler excluded, a stopped job:
their exit codes kept).

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


def under_launcher() -> bool:
    """Whether this process is a rank a torchelastic launcher (torchrun, ft_launcher) started."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def exit_code(exc: BaseException) -> int:
    """The status the interpreter would have exited with for ``exc``."""
    if isinstance(exc, SystemExit):
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 1


def leave_now(exc: BaseException, one_line: tuple[str, int] | None = None) -> None:
    """End the process's multiprocessing children (a writer's Manager would otherwise outlive it:
    the interpreter's exit handler that stops them is skipped), print ``one_line``'s line (else
    ``exc`` as an uncaught exception is printed), flush, and end the process with ``one_line``'s
    status (else the interpreter's for ``exc``). Never returns."""
    code = one_line[1] if one_line is not None else exit_code(exc)
    try:
        for child in multiprocessing.active_children():
            child.kill()
        if one_line is not None:
            print(one_line[0], file=sys.stderr)
        elif not isinstance(exc, SystemExit):
            traceback.print_exception(exc, file=sys.stderr)
        logging.shutdown()  # flushes every handler (the rank's log lines before the traceback)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)

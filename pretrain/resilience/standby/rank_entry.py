"""What a forked rank runs: it takes on the client's streams, environment, directory, command
line, CPU affinity and NUMA memory policy, dies with its client, and runs the client's module as
``python -m MODULE`` would (for a rank, ``pretrain``: already imported by the server)."""

from __future__ import annotations

import os
import runpy
import select
import signal
import sys
import tempfile
import threading

import torch

from pretrain.resilience.standby import placement
from pretrain.resilience.standby.wire import JOB_SIGNALS, RankRequest


def _die_with_client(pidfd: int) -> None:
    """The launcher sees the client, not this process: when the client ends (killed with its
    process group, or SIGKILLed alone), the rank ends at once, as it would have with it, and so
    does everything it started (its process group, as the launcher's ``killpg`` would have)."""
    select.select([pidfd], [], [])
    os.killpg(0, signal.SIGKILL)


def take_over(request: RankRequest) -> None:
    """Become the client's rank: its session, streams, environment, directory and argv."""
    os.setsid()  # out of the server's process group: a signal to the server is not one to the rank
    placement.apply(request.placement)  # numactl/affinity bound the client: the rank, before it allocates
    for target, fd in enumerate(request.stdio):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request.env)
    tempfile.tempdir = None  # the server's TMPDIR may have been cached by an import: the rank's counts
    os.chdir(request.cwd)
    sys.argv = list(request.argv)
    # The server ignores the job's signals (they are the ranks'): a rank starts with Python's defaults.
    for sig in (*JOB_SIGNALS, signal.SIGCHLD):
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # read by the OpenMP runtime when the server loaded it
        torch.set_num_threads(int(threads))
    threading.Thread(target=_die_with_client, args=(request.client_pidfd,), name="standby-client", daemon=True).start()


def run(request: RankRequest) -> None:
    """Run the client's module as ``python -m`` would; its ``SystemExit`` ends this process."""
    take_over(request)
    os.umask(0o077)  # as python -m pretrain does: the fork's files are private
    runpy.run_module(request.module, run_name="__main__", alter_sys=True)

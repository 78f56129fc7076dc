"""Start a standby server beside a launcher: ``python -m pretrain.resilience.standby.beside --
LAUNCHER ARGS...`` starts the server, puts its address in the environment and execs the launcher
(same pid, so whoever started it still holds the launcher). The server gets
``PR_SET_PDEATHSIG``: it ends when the launcher does, however the launcher ends. Where the
environment names a shared server (``wire.SHARED_ENV``: one that outlives launchers, as the test
suite keeps per worker), the launcher uses that one and none is started.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import subprocess
import sys
from typing import IO

from pretrain.resilience.standby import wire

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """In the server, before exec: SIGKILL when the parent (the launcher-to-be) ends; the job's
    signals blocked until the server has set them to be ignored (a scancel in its first
    milliseconds, before Python runs its code, would otherwise end it)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, wire.JOB_SIGNALS)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # the parent ended before the prctl: nothing would kill us later
        os._exit(0)


def start_server(env: dict[str, str], output: IO[bytes] | None = None) -> subprocess.Popen[bytes]:
    """Start a standby server as this process's child, and set its address in ``env``. ``output``:
    where its own messages go (default: this process's stdout and stderr)."""
    name = f"pretrain-standby-{os.getpid()}-{secrets.token_hex(4)}"
    parent = os.getpid()
    # Bound and listening before anything can look for it: a client that comes while the server
    # is still importing waits in the backlog instead of finding nobody.
    with wire.listen(name) as listener:
        server = subprocess.Popen(
            [sys.executable, "-u", "-m", "pretrain.resilience.standby.server", str(listener.fileno())],
            env={k: v for k, v in env.items() if k != wire.ENV},
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=output,
            pass_fds=[listener.fileno()],
            preexec_fn=lambda: _die_with_parent(parent),  # noqa: PLW1509 (single-threaded here)
        )
    env[wire.ENV] = name
    return server


def with_standby(command: list[str]) -> list[str]:
    """``command`` (a launcher) run with a standby server beside it."""
    return [sys.executable, "-m", "pretrain.resilience.standby.beside", "--", *command]


def main(argv: list[str]) -> None:
    if not argv or argv[0] != "--" or len(argv) < 2:
        sys.exit("usage: python -m pretrain.resilience.standby.beside -- LAUNCHER [ARGS...]")
    command = argv[1:]
    env = dict(os.environ)
    shared = env.get(wire.SHARED_ENV)
    if shared:  # a server that outlives launchers is already running (see wire.SHARED_ENV)
        env[wire.ENV] = shared
    else:
        start_server(env)
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    main(sys.argv[1:])

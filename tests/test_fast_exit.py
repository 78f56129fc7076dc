"""A failed rank under a launcher leaves at once: the traceback as the interpreter prints it, its
log lines flushed, its exit status, and no wait for what the teardown would join (a non-daemon
thread, a multiprocessing child)."""

from __future__ import annotations

import subprocess
import sys
import time

from pretrain.resilience.fast_exit import exit_code
from tests.helpers import process_ended

PROGRAM = """
import logging, multiprocessing, sys, threading, time
from pretrain.resilience.fast_exit import leave_now
logging.basicConfig(level=logging.INFO)
threading.Thread(target=time.sleep, args=(60,)).start()  # non-daemon: a normal exit waits for it
child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
child.start()
print("child", child.pid, flush=True)
logging.getLogger("rank").error("rank 1 failed (user): RuntimeError: boom")
try:
    raise RuntimeError("boom")
except RuntimeError as exc:
    leave_now(exc, ("config error: x.yaml: boom; fix: y", 2) if sys.argv[1:] == ["one-line"] else None)
"""


def test_a_failed_rank_leaves_at_once_with_its_traceback_and_without_its_children() -> None:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert done.returncode == 1
    assert took < 20, f"it waited for the thread or the child: {took:.1f}s"
    assert "rank 1 failed (user)" in done.stderr and done.stderr.rstrip().endswith("RuntimeError: boom")
    assert "Traceback (most recent call last)" in done.stderr
    child = int(done.stdout.split("child ")[1].split()[0])
    deadline = time.monotonic() + 5
    while not process_ended(child):
        assert time.monotonic() < deadline, "the multiprocessing child outlived the rank"
        time.sleep(0.05)


def test_an_error_the_user_needs_one_line_for_ends_with_that_line_and_status() -> None:
    """As ``pretrain train`` ends a config, data or lease error: one line, no traceback, exit 2."""
    done = subprocess.run([sys.executable, "-c", PROGRAM, "one-line"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.rstrip().endswith("config error: x.yaml: boom; fix: y") and "Traceback" not in done.stderr


def test_the_exit_status_is_the_one_the_interpreter_would_give() -> None:
    assert exit_code(RuntimeError("x")) == 1
    assert exit_code(SystemExit(3)) == 3 and exit_code(SystemExit(None)) == 0 and exit_code(SystemExit("x")) == 1

"""A rank-like process whose tier-1 write gets stuck in a stalled file system, then leaves.

``python -m tests.stuck_writer TMP MOUNT MODE GATE LOG``: builds tier 1 on ``MOUNT`` (a gated FUSE
mount whose daemon writes ``LOG``) with ``checkpoint.async.mode=MODE``, closes the mount's gate
(creates ``GATE``), saves step 10 in the background, waits until the daemon holds one of its writes,
polls until the stall deadline marks the tier stalled, prints ``stalled <writer pid or 0>`` and
returns from main, as a rank that finishes (or fails) does. Whether the process then really
exits while the write is stuck in the kernel is what tests/test_stalled_storage.py asserts.

Why it waits for the daemon: the kernel lets a SIGKILL (the tier's abandon of a stalled fork
writer) end a FUSE write whose request the daemon has not read yet; only a request the daemon
holds keeps the writer in the kernel. On a loaded machine the daemon can read it late.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tests.test_restore_selection import _cfg, _state, _tiers, _train_to
from tiering.errors import PublishError


def main() -> int:
    tmp, mount, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    gate, daemon_log = Path(sys.argv[4]), Path(sys.argv[5])
    cfg = _cfg(
        tmp,
        f"checkpoint.local.dir={mount}",
        "checkpoint.local.stall_timeout_s=1.0",
        f"checkpoint.async.mode={mode}",
    )
    tiers, state = _tiers(cfg), _state(cfg)
    gate.write_bytes(b"closed")  # from now on every data write under the mount blocks
    _train_to(state, 10)
    tiers.start_async(state)
    write = tiers._inflight["write"] if tiers._inflight is not None else None
    pid = write.pid if write is not None and write.pid is not None else 0
    if not _held(daemon_log, within_s=30):
        print("never held", flush=True)
        return 1
    end = time.monotonic() + 30
    try:
        while tiers.poll_async() is None:
            if time.monotonic() > end:
                print("never stalled", flush=True)
                return 1
            time.sleep(0.05)
    except PublishError as exc:
        print(f"stalled {pid} {exc}", flush=True)
        return 0
    print("published", flush=True)
    return 1


def _held(daemon_log: Path, within_s: float) -> bool:
    """Whether the gated daemon says it holds a write (``holding write to PATH``) within ``within_s``."""
    end = time.monotonic() + within_s
    while b"holding write to" not in daemon_log.read_bytes():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


if __name__ == "__main__":
    sys.exit(main())

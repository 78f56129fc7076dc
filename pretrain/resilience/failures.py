"""Failure classification: what kind of failure ended a rank, and whether a restart can help.

* infrastructure: a lost rank, a collective timeout or connection error, a full disk, an object
  store that is unreachable, a kill or a hang. Restarting (on other hardware if needed) helps:
  retried up to the launcher budget.
* numerical: a NaN/Inf loss or gradient norm. A restart from the same checkpoint repeats it unless
  that checkpoint is quarantined (poison handling), so it is retried from an older step.
* data: corrupt or missing input data. A restart does not fix it.
* user: an exception from our code, the user's code or config. Deterministic: confirmed once, then
  the job stops instead of burning the restart budget.
* preempted: the scheduler asked us to leave (SIGTERM/SIGUSR1); not a failure of the job.
* straggler: a node was excluded as a persistent straggler; the job restarts without it.
"""

from __future__ import annotations

import errno
import traceback
from dataclasses import asdict, dataclass
from enum import Enum

from pretrain.errors import ConfigError, DataError, NonFiniteError, PreemptedError, StragglerExcluded
from tiering.errors import CheckpointError, ObjectStoreError


class Classification(str, Enum):
    INFRASTRUCTURE = "infrastructure"
    NUMERICAL = "numerical"
    DATA = "data"
    USER = "user"
    PREEMPTED = "preempted"
    STRAGGLER = "straggler"


# Substrings of the errors torch.distributed/gloo/NCCL raise when a peer dies or a collective times out.
_PEER_LOST_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "nccl communicator was aborted",
    "ncclremoteerror",
    "socket closed",
    "connection refused",
    "connection lost",
)


@dataclass
class FailureInfo:
    classification: str
    exception: str | None
    exit_code: int | None
    peer_lost: bool = False
    traceback_tail: str | None = None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @property
    def signature(self) -> str:
        """What must match for a failure to count as "raised identically after a restart"."""
        return f"{self.classification}:{self.exception}"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:800]}"  # long enough for a one-line error with paths and fix


def classify(exc: BaseException) -> FailureInfo:
    """Map an exception that ended a rank to a :class:`Classification`."""
    import torch.distributed as dist  # deferred: `pretrain status` reads failures without torch

    tail = "".join(traceback.format_exception(exc)[-3:])[-1200:]
    message = _one_line(exc)
    lowered = str(exc).lower()
    if isinstance(exc, PreemptedError):
        return FailureInfo(Classification.PREEMPTED.value, exc.message, PreemptedError.EXIT_CODE)
    if isinstance(exc, StragglerExcluded):
        return FailureInfo(Classification.STRAGGLER.value, exc.message, int(exc.code))  # type: ignore[arg-type]
    if isinstance(exc, NonFiniteError):
        return FailureInfo(Classification.NUMERICAL.value, message, 1, traceback_tail=tail)
    if isinstance(exc, DataError):
        return FailureInfo(Classification.DATA.value, message, 1, traceback_tail=tail)
    dist_errors: tuple[type[BaseException], ...] = tuple(
        t for t in (getattr(dist, "DistError", None), getattr(dist, "DistBackendError", None)) if t
    )
    # NVRx's RankMonitorClientError: the launcher-side monitor of this rank went away.
    # RankShouldRestart: NVRx's in-process Wrapper aborted this rank because another one failed.
    monitor_lost = type(exc).__name__ in ("RankMonitorClientError", "RankShouldRestart")
    peer_lost = monitor_lost or any(m in lowered for m in _PEER_LOST_MARKERS)
    if isinstance(exc, dist_errors) or peer_lost or isinstance(exc, (ConnectionError, TimeoutError)):
        return FailureInfo(Classification.INFRASTRUCTURE.value, message, 1, peer_lost=True, traceback_tail=tail)
    if isinstance(exc, ObjectStoreError):  # the object store is unreachable or refused: not our code
        return FailureInfo(Classification.INFRASTRUCTURE.value, message, 1, traceback_tail=tail)
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EROFS):
        return FailureInfo(Classification.INFRASTRUCTURE.value, message, 1, traceback_tail=tail)
    if isinstance(exc, (ConfigError, CheckpointError)):
        return FailureInfo(Classification.USER.value, message, 2, traceback_tail=tail)
    if isinstance(exc, MemoryError):
        return FailureInfo(Classification.INFRASTRUCTURE.value, message, 1, traceback_tail=tail)
    return FailureInfo(Classification.USER.value, message, 1, traceback_tail=tail)

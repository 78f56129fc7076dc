"""NVRx fault-tolerance hooks for the rank program: heartbeats and deliberate fault injection."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from pretrain.config import Config

log = logging.getLogger(__name__)

try:
    from nvidia_resiliency_ext.fault_tolerance.data import FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR
except ImportError:  # pragma: no cover - NVRx is a hard dependency; keep the name stable anyway
    FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR = "FT_RANK_MONITOR_IPC_SOCKET"


def launcher_restart_count() -> int:
    """How many times the launcher restarted the worker group (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def restart_counters() -> dict[str, object]:
    """Every restart counter the environment knows, for the attempt record."""
    env = os.environ
    out: dict[str, object] = {"launcher_restart_count": launcher_restart_count()}
    if env.get("SLURM_JOB_ID"):
        out["slurm_job_id"] = env["SLURM_JOB_ID"]
        out["slurm_restart_count"] = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    if env.get("KUBERNETES_SERVICE_HOST"):
        out["pod"] = env.get("HOSTNAME")
        out["pod_restart_count"] = int(env.get("RESTART_COUNT", "0") or 0)
    return out


class Heartbeat:
    """Sends NVRx heartbeats when running under ``ft_launcher``; a no-op otherwise."""

    def __init__(self, cfg: Config) -> None:
        self.client = None
        # Set by the trainer: true once a preemption signal arrived. Slurm and Kubernetes signal
        # every process, so NVRx's rank monitor may die before this rank reaches its emergency save.
        self.leaving: Callable[[], bool] = lambda: False
        if cfg.fault_tolerance.enabled and os.environ.get(FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR):
            from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

            self.client = RankMonitorClient()
            self.client.init_workload_monitoring()
            log.info("ft_launcher rank monitor connected: heartbeats on")

    @property
    def active(self) -> bool:
        return self.client is not None

    def beat(self) -> None:
        if self.client is None:
            return
        try:
            self.client.send_heartbeat()
        except Exception:
            # The monitor is gone. During a shutdown that is expected: stop beating and let the
            # emergency save run. Otherwise it is an infrastructure failure of this rank.
            for _ in range(20):  # the signal may trail the monitor's death by a few milliseconds
                if self.leaving():
                    log.warning("rank monitor gone during shutdown: heartbeats off")
                    self.client = None
                    return
                time.sleep(0.05)
            raise

    def close(self) -> None:
        if self.client is not None:
            self.client.shutdown_workload_monitoring()
            self.client = None


def maybe_inject_fault(cfg: Config, rank: int, step: int, record, node: str | None = None) -> None:  # noqa: ANN001
    """SIGKILL this rank (or every rank of a node) at the configured step, on the first attempt only."""
    inj = cfg.fault_tolerance.inject
    chosen = inj.kill_rank == rank or (inj.kill_node is not None and inj.kill_node == node)
    first = launcher_restart_count() == 0 or inj.every_attempt
    if inj.raise_at_step == step:
        raise RuntimeError(f"injected user-code error at step {step}")
    if chosen and inj.kill_at_step == step and first:
        record("fault_injected", force=True, rank=rank, step=step, signal="SIGKILL", node=node)
        log.warning("fault injection: rank %d SIGKILLs itself at step %d", rank, step)
        os.kill(os.getpid(), signal.SIGKILL)
    if inj.hang_rank == rank and inj.hang_at_step == step and first:
        record("fault_injected", force=True, rank=rank, step=step, signal="hang", node=node)
        log.warning("fault injection: rank %d hangs at step %d (no more heartbeats)", rank, step)
        while True:  # a hang: alive, silent, holding its peers in the next collective
            time.sleep(3600)


def maybe_poison_restored(cfg: Config, restored_step: int, model: Any) -> None:
    """Drill: a checkpoint that verifies but is poisoned (a NaN weight), every time it is restored."""
    if cfg.fault_tolerance.inject.poison_restored_step != restored_step:
        return
    import torch

    log.warning("fault injection: step %d restored with a NaN weight", restored_step)
    with torch.no_grad():
        next(p for p in model.parameters() if p.numel() > 0).view(-1)[0] = float("nan")

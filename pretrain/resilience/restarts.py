"""Which attempt this is: the launcher's restart count, the in-process incarnation, and every
restart counter the environment knows (ft_launcher/torchrun, Slurm requeues, Kubernetes pods)."""

from __future__ import annotations

import os

# Set by the in-process restart wrapper for each incarnation (0 without in-process restarts).
INCARNATION_ENV = "RP_INPROCESS_ITERATION"


def incarnation() -> int:
    """Index of the current in-process restart (0 without in-process restarts)."""
    return int(os.environ.get(INCARNATION_ENV, "0"))


def launcher_restart_count() -> int:
    """How many times this node's launcher restarted its worker group (0 on the first attempt).
    Counts are per launcher: on several nodes they can differ for the same attempt."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def first_attempt() -> bool:
    """The launcher's first start and, with in-process restarts, the first incarnation."""
    return launcher_restart_count() == 0 and incarnation() == 0


def restart_counters() -> dict[str, object]:
    """Every restart counter the environment knows, for the attempt record."""
    env = os.environ
    out: dict[str, object] = {"launcher_restart_count": launcher_restart_count()}
    if env.get("TORCHELASTIC_RUN_ID"):
        out["launcher_run_id"] = env["TORCHELASTIC_RUN_ID"]
    if env.get("SLURM_JOB_ID"):
        out["slurm_job_id"] = env["SLURM_JOB_ID"]
        out["slurm_restart_count"] = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    if env.get("KUBERNETES_SERVICE_HOST"):
        out["pod"] = env.get("HOSTNAME")
        out["pod_restart_count"] = int(env.get("RESTART_COUNT", "0") or 0)
    return out

"""The ``ft_launcher`` command line that runs the rank program (one node)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from pretrain.resilience.standby.beside import with_standby

# How often ft_launcher looks at its workers: half of it, on average, is added to the detection of
# every rank's failure. Not torchrun's 0.1 s: measured with the soak (kill-job only, 3 faults, two
# seeds, this 2-core machine), a new job took 6.2-7.9 s from the kill to its next step at 0.1 s
# against 4.3-6.8 s at 0.5 s (the new launcher's own start, 5.0-5.9 s against 3.5-5.0 s), while a
# rank's failure gains 0.2 s on average; `pretrain launch` used 1 s before 2026-12-07.
MONITOR_INTERVAL_S = 0.5


def ft_launcher_command(
    config: Path | str,
    nproc: int,
    ft_config: Path | str,
    max_restarts: int = 3,
    overrides: list[str] | tuple[str, ...] = (),
    rdzv_port: int | None = None,
    nnodes: int = 1,
    rdzv_host: str = "127.0.0.1",
    standby: bool = True,
) -> list[str]:
    """``ft_launcher`` for one node: standalone, or (``rdzv_port``) c10d rendezvous across ``nnodes``
    agents; ``standby``: ranks start as forks of a pre-imported process beside the launcher."""
    launcher = shutil.which("ft_launcher") or str(Path(sys.executable).with_name("ft_launcher"))
    cmd = [
        launcher,
        "--standalone" if rdzv_port is None else f"--rdzv-endpoint={rdzv_host}:{rdzv_port}",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        f"--monitor-interval={MONITOR_INTERVAL_S}",
        "--workers-stop-timeout=5",
        # NVRx 0.4.1 ignores enable_nic_monitor in the YAML: it must be a flag.
        "--ft-enable-nic-monitor=false",
        f"--ft-cfg-path={ft_config}",
    ]
    if rdzv_port is not None:
        cmd[2:2] = ["--rdzv-backend=c10d", "--rdzv-id=resilient-pretrain"]
    cmd += ["-m", "pretrain", "train", "--config", str(config)]
    for item in overrides:
        cmd += ["--set", item]
    return with_standby(cmd) if standby else cmd

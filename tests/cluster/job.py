"""Running the real entrypoint on a :class:`~tests.cluster.netns.Cluster`.

Contract: :func:`start_node` starts ``pretrain launch`` on one node exactly as a Kubernetes
StatefulSet pod would (``HOSTNAME=pretrain-<i>`` from the node's UTS namespace, ``NNODES``,
``RDZV_HOST=pretrain-0`` resolved through the node's ``/etc/hosts``, ``LOCAL_NVME`` = the node's
disk, ``FAILURE_DOMAIN``, ``RUN_ID``), so one ``ft_launcher`` per node rendezvouses over the bridge
(c10d). The run directory (attempt records, metrics, events) is shared by every node, as on a
cluster's shared file system. :func:`wait_metric_step` and :func:`wait_exit` wait on the job's own
records and processes, never on a guessed sleep.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

from tests.cluster.netns import Cluster
from tests.helpers import PYTHON, REPO, TINY, read_jsonl

FT_CLUSTER = Path(__file__).with_name("ft-cluster.yaml")
RDZV_PORT = 29400


def node_env(cluster: Cluster, index: int, run_id: str, nnodes: int) -> dict[str, str]:
    node = cluster.nodes[index]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "NODE_", "FAILURE_", "TORCHELASTIC"))}
    env.pop("POD_NAME", None)
    sockets = Path(tempfile.mkdtemp(prefix="rpc-", dir="/tmp"))  # NVRx unix sockets: a short per-node path
    cluster.scratch.append(sockets)
    env.update(
        TMPDIR=str(sockets),
        PYTHONWARNINGS="ignore",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
        NNODES=str(nnodes),
        RDZV_HOST=cluster.node_name(0),
        RDZV_PORT=str(RDZV_PORT),
        LOCAL_NVME=str(node.nvme),
        FAILURE_DOMAIN=node.domain,
        RUN_ID=run_id,
        # The netns bridge reaches only this machine's nodes: a private job network, so NVRx 0.4.1's
        # pickled rendezvous is allowed (pretrain launch refuses it otherwise).
        RDZV_PRIVATE_NETWORK="1",
    )
    return env


def start_node(
    cluster: Cluster,
    index: int,
    overrides: list[str],
    run_id: str = "t",
    nnodes: int | None = None,
    max_restarts: int = 2,
    log_dir: Path | None = None,
    prefix: list[str] | None = None,
    ft_config: Path = FT_CLUSTER,
) -> subprocess.Popen[str]:
    """``pretrain launch`` (one rank per node) on node ``index`` of ``cluster``; ``prefix`` runs
    before it on the node (e.g. :func:`node_local_mount`)."""
    argv = [
        *(prefix or []),
        PYTHON,
        "-m",
        "pretrain",
        "launch",
        "--config",
        str(TINY),
        "--nproc-per-node",
        "1",
        "--max-restarts",
        str(max_restarts),
        "--ft-config",
        str(ft_config),
    ]
    for item in overrides:
        argv += ["--set", item]
    env = node_env(cluster, index, run_id, nnodes or cluster.count)
    log = (log_dir or cluster.workdir) / f"node-{index}.log"
    return cluster.popen(index, argv, env, log)


def metric_rows(run_dir: Path) -> list[dict]:
    try:
        rows = read_jsonl(run_dir / "metrics.jsonl")
    except OSError:
        return []
    return [r for r in rows if r.get("kind", "train") == "train"]


def wait_metric_step(run_dir: Path, step: int, procs: list[subprocess.Popen[str]], timeout: float = 240) -> float:
    """Wait until ``metrics.jsonl`` records ``step``; returns the time it was first seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r["step"] >= step for r in metric_rows(run_dir)):
            return time.time()
        dead = [p.args for p in procs if p.poll() is not None]
        if dead:
            raise AssertionError(f"a node exited before step {step}: {dead[0][-12:]}")
        time.sleep(0.05)
    raise AssertionError(f"step {step} never appeared in {run_dir}/metrics.jsonl")


def wait_exit(procs: dict[int, subprocess.Popen[str]], timeout: float = 300) -> dict[int, int | None]:
    """Each node's exit status; a node still running at the deadline is reported as None (the
    caller's cluster close kills it)."""
    deadline = time.monotonic() + timeout
    out: dict[int, int | None] = {}
    for index, proc in procs.items():
        try:
            out[index] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            out[index] = None
    return out


def node_local_mount(node_dir: Path, path: Path) -> list[str]:
    """A ``start_node`` prefix: on that node, ``path`` is ``node_dir`` (a mount namespace of its
    own, as a node's local disk mounted where shared storage belongs)."""
    node_dir.mkdir(parents=True, exist_ok=True)
    path.mkdir(parents=True, exist_ok=True)
    script = 'mount --bind "$0" "$1" && shift && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(node_dir), str(path)]

"""Shared helpers for the real multi-process tests: launch jobs, read their records."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from pretrain.resilience.standby.beside import with_standby
from pretrain.resilience.standby.wire import ENV as STANDBY_ENV
from pretrain.resilience.standby.wire import SHARED_ENV
from tests.shared_standby import address as shared_standby_address
from tiering.layout import RunLayout
from tiering.local.publish import ReceivedStep
from tiering.trust.run_key import RunKey

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TINY = REPO / "configs" / "tiny-cpu.yaml"
FT_CPU = REPO / "configs" / "ft-cpu.yaml"
# The shared reference run (the ``reference_40`` fixture, tests/conftest.py): a test compared with it
# step by step sets ``schedule.decay_steps`` to its length, whatever its own ``train.steps``.
REFERENCE_STEPS = 40
REFERENCE_40 = {"train.steps": REFERENCE_STEPS, "checkpoint.local.interval": 10, "checkpoint.reshardable.interval": 20}


def job_env(tmp: Path, shared_standby: bool = True) -> dict[str, str]:
    """Each job gets its own short TMPDIR: NVRx puts its unix sockets there (108-byte path limit).
    ``shared_standby``: its ranks are forks of the test process's shared standby server
    (tests/shared_standby.py); False: its launcher starts its own, so that every process of the
    job carries this environment in /proc/PID/environ."""
    tmp.mkdir(parents=True, exist_ok=True)
    sock_dir = tempfile.mkdtemp(prefix="rp-", dir="/tmp")
    (tmp / "sockets").write_text(sock_dir)
    env = {**os.environ, "TMPDIR": sock_dir, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    shared = shared_standby_address() if shared_standby else None
    if shared is not None:
        env[SHARED_ENV] = shared
    return env


def overrides_for(tmp: Path, corpus: Path, **extra: Any) -> list[str]:
    items = {
        "run.dir": str(tmp / "runs"),
        "run.id": "t",
        "data.prefix": str(corpus),
        "checkpoint.local.dir": str(tmp / "ckpt"),
        "checkpoint.reshardable.dir": str(tmp / "reshard"),
        # Tier 0's default (auto) would put every test job's slots in the machine's /dev/shm and
        # restore from them first: a job test names the tiers it is about. The default itself is
        # tested in test_memory_tier.py (auto on, and auto off for a tmpfs too small).
        "checkpoint.memory.enabled": "false",
        **extra,
    }
    return [f"{k}={v}" for k, v in items.items()]


def blend_override(a: Path, b: Path, wa: float, wb: float) -> str:
    """``data.blend`` of two prefixes, as a ``--set`` value."""
    return f"[{{prefix: {a}, weight: {wa}}}, {{prefix: {b}, weight: {wb}}}]"


def kill_rank_at(rank: int, step: int) -> dict[str, int]:
    """Overrides: ``rank`` SIGKILLs itself at ``step`` (first attempt only)."""
    return {"fault_tolerance.inject.kill_rank": rank, "fault_tolerance.inject.kill_at_step": step}


def torchrun_prefix(nproc: int, standby: bool = True) -> list[str]:
    """``torchrun --standalone`` for ``nproc`` local ranks, with this interpreter; ``standby``: with a
    standby server beside it (for ``-m pretrain`` ranks; a script rank would not use it)."""
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return with_standby(cmd) if standby else cmd


def torchrun(
    tmp: Path, nproc: int, overrides: list[str], config: Path = TINY, timeout: int = 300, check: bool = True
) -> subprocess.CompletedProcess[str]:
    cmd = [*torchrun_prefix(nproc), "-m", "pretrain", "train", "--config", str(config)]
    for item in overrides:
        cmd += ["--set", item]
    return run(cmd, tmp, timeout, check)


def ft_launch(
    tmp: Path,
    nproc: int,
    overrides: list[str],
    config: Path = TINY,
    max_restarts: int = 3,
    timeout: int = 300,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    from pretrain.commands.ft_command import ft_launcher_command

    cmd = ft_launcher_command(config, nproc=nproc, ft_config=FT_CPU, max_restarts=max_restarts, overrides=overrides)
    return run(cmd, tmp, timeout, check)


def run(
    cmd: list[str], tmp: Path, timeout: int, check: bool, pythonpath: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``cmd`` in ``tmp`` with ``job_env``'s environment (``pythonpath`` put first on PYTHONPATH)."""
    tmp.mkdir(parents=True, exist_ok=True)
    env = job_env(tmp)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp)
    (tmp / "job.log").write_text(proc.stdout + proc.stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"job failed ({proc.returncode}): {' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-6000:]}")
    return proc


def run_verb(tmp: Path, verb: str, workdir: Path, timeout: int) -> subprocess.CompletedProcess[str]:
    """``pretrain <verb> --workdir <workdir>`` as a user runs it (demo, drill)."""
    cmd = [PYTHON, "-m", "pretrain", verb, "--workdir", str(workdir)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=job_env(tmp))


def metrics_by_step(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Per-step training metrics; a recomputed step keeps its last (post-restore) record."""
    out: dict[int, dict[str, Any]] = {}
    for rec in read_jsonl(run_dir / "metrics.jsonl"):
        if rec.get("kind", "train") == "train":  # validation records have their own kind
            out[rec["step"]] = rec
    return out


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (metrics.jsonl, events.jsonl, data-audit/rank-N.jsonl), in order."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def events(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(run_dir / "events.jsonl")


def full_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Megatron/torch distributed checkpoint, as full (unsharded) tensors."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "full.pt"
        dcp_to_torch_save(str(model_dir), str(out))
        loaded = torch.load(out, weights_only=False)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            flat[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)

    walk("", loaded)
    return flat


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_nodes(
    tmp: Path, overrides: list[str], max_restarts: int, nproc: int = 2, named: bool = True
) -> dict[str, subprocess.Popen[str]]:
    """Two ft_launcher agents on this machine as two simulated nodes (c10d rendezvous), started.

    Node ``node-a`` is failure domain ``rack-a`` with local root ``tmp/local-node-a``; likewise b.
    ``named=False``: no NODE_NAME (both report this host's name).
    """
    from pretrain.commands.ft_command import ft_launcher_command

    port = free_port()
    procs = {}
    for node in ("node-a", "node-b"):
        node_overrides = [*overrides, f"checkpoint.local.dir={tmp / f'local-{node}'}"]
        cmd = ft_launcher_command(
            TINY,
            nproc=nproc,
            ft_config=FT_CPU,
            max_restarts=max_restarts,
            overrides=node_overrides,
            rdzv_port=port,
            nnodes=2,
        )
        env = job_env(tmp / node)
        for var in ("NODE_NAME", "SLURMD_NODENAME", "FAILURE_DOMAIN"):
            env.pop(var, None)
        if named:
            env.update(NODE_NAME=node, FAILURE_DOMAIN=node.replace("node", "rack"))
        procs[node] = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp
        )
    return procs


def wait_nodes(tmp: Path, procs: dict[str, subprocess.Popen[str]], timeout: int = 420) -> dict[str, str]:
    """Each node's output once it exited (also in ``tmp/<node>.log``); kills every node on a timeout."""
    out = {}
    try:
        for node, proc in procs.items():
            out[node] = proc.communicate(timeout=timeout)[0]
            (tmp / f"{node}.log").write_text(out[node])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return out


def two_node_launch(
    tmp: Path, overrides: list[str], max_restarts: int, timeout: int = 420, nproc: int = 2
) -> dict[str, subprocess.CompletedProcess[str]]:
    """:func:`start_nodes` then :func:`wait_nodes`."""
    procs = start_nodes(tmp, overrides, max_restarts, nproc)
    outs = wait_nodes(tmp, procs, timeout)
    return {n: subprocess.CompletedProcess(p.args, p.returncode, outs[n], "") for n, p in procs.items()}


def probe_restore(tmp: Path, nproc: int, overrides: list[str], timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """Restore the newest step into the topology of ``overrides`` and re-save it (tests/probe_restore.py),
    its ranks forked from the standby process as a job's are (``tests`` importable from the repo)."""
    cmd = [*torchrun_prefix(nproc), "-m", "tests.probe_restore", str(TINY), *overrides]
    return run(cmd, tmp, timeout, check=True, pythonpath=REPO)


def flip_byte(path: Path) -> None:
    """Real corruption: one bit flipped in the middle of a file."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def arrived(
    layout: RunLayout, claims: tuple[str, int, int], manifest_raw: bytes, files: dict[str, bytes], attempt: str = "a1"
) -> ReceivedStep:
    """Files as the transport leaves them in a receiver's temporary directory, sent by a peer
    claiming ``(run id, step, owner)``, with nothing checked on arrival (``publish_received`` then
    checks them on disk, as it does for format v1 steps)."""
    run_id, step, owner = claims
    directory = layout.tmp_dir(step, attempt)
    directory.mkdir(parents=True)
    for rel, data in files.items():
        (directory / rel).write_bytes(data)
    header = {"run_id": run_id, "step": step, "owner": owner}
    return ReceivedStep(header, manifest_raw, directory, [(rel, len(data)) for rel, data in files.items()])


@contextlib.contextmanager
def tmpfs(path: Path, size_mb: int) -> Iterator[Path]:
    """A real tmpfs of ``size_mb`` MiB mounted at ``path`` (root), unmounted whatever happens: a full
    disk or a small memory volume for a test."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def two_gloo_ranks(
    scenario: Callable[[int, Path], dict[str, Any]], root: Path, timeout: int = 240, default_backend: str = "gloo"
) -> tuple[dict[str, Any], ...]:
    """``scenario(rank, root)`` in two gloo ranks (a picklable, module-level callable); each rank's
    JSON result, in rank order. The ranks are ``python -m tests.gloo_rank`` processes forked from the
    worker's shared standby process (no torch import each); one that fails fails the call, with
    both ranks' output, and the other is killed. ``default_backend="fake"``: the default group is
    torch's fake one (a NCCL stand-in, see ``tests/gloo_rank.py``); gloo groups are made beside it."""
    root.mkdir(parents=True, exist_ok=True)
    scenario_file = root / "scenario.pickle"
    scenario_file.write_bytes(pickle.dumps(scenario))
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    shared = shared_standby_address()
    if shared is not None:
        env[STANDBY_ENV] = shared
    port = str(free_port())
    cmd = [PYTHON, "-m", "tests.gloo_rank"]
    ranks = [
        subprocess.Popen(
            [*cmd, str(rank), str(scenario_file), str(root), port, default_backend],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outs = [proc.communicate(timeout=timeout)[0] for proc in ranks]
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if any(proc.returncode != 0 for proc in ranks):
        report = "\n".join(
            f"rank {r} exited {p.returncode}:\n{out[-3000:]}"
            for r, (p, out) in enumerate(zip(ranks, outs, strict=True))
        )
        raise AssertionError(f"two_gloo_ranks: {report}")
    return tuple(json.loads((root / f"result-{r}.json").read_text()) for r in range(2))


def agents_serving(marker: Path | str) -> list[int]:
    """Pids of the checkpoint agents whose spec names ``marker`` (a tier-0 root or a run
    directory), alive and not zombies."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"pretrain.checkpointing.agent" in cmd and str(marker).encode() in cmd and not process_ended(int(proc.name)):
            found.append(int(proc.name))
    return found


def process_ended(pid: int) -> bool:
    """Whether ``pid`` is gone or a zombie (a child of this test that exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


# The run key of in-test gloo ranks (the same on every rank, as a run's key file makes it).
TEST_KEY = RunKey(b"resilient-pretrain-test-run-key!")

"""In-process restart (``fault_tolerance.inprocess.enabled``) with NVRx's ``inprocess.Wrapper``.

A fault on any rank (an exception, a rank that stops making progress) aborts every rank's
collectives and re-runs the training function in the *same* processes, so a restart costs a
process-group rendezvous and a restore from host memory instead of new processes, imports and
a disk read. What cannot be interrupted in-process (a hang inside native code) is left to the
outer layer: the hard timeout terminates the rank and ``ft_launcher`` restarts the group.

Each incarnation creates its process group and Megatron's parallel state itself, on a fresh
prefix of a TCP store made once per process (re-initialising torch.distributed against the same
store keys fails); ``ResetTrainingState`` tears them down between incarnations. Each incarnation
selects the rank's GPU (``LOCAL_RANK``) before it starts NCCL. The threaded finalizer that NVRx
ships needs CUDA, hence our own.

On NCCL (NVRx's usage guide): the groups' timeout outlasts the Wrapper's hard timeout (the
watchdog would otherwise terminate the process first), :data:`NCCL_ENV` is set before the first
NCCL group (a CUDA error is not rethrown from the watchdog; NVLS off, its abort can hang), and a
CUDA health check (a bounded device synchronize) runs before each restart. On gloo the health
check is a no-op.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from nvidia_resiliency_ext import inprocess

from pretrain.checkpointing.reshardable import reset_writer
from pretrain.config import Config, S3TierConfig
from pretrain.platform.rank_device import select_rank_device
from pretrain.resilience.collective_abort import IncarnationConnections
from pretrain.resilience.restarts import INCARNATION_ENV

log = logging.getLogger(__name__)

# What NVRx's in-process restart needs of NCCL, set (unless the launcher set them) before the first
# NCCL group exists: NCCL reads them at communicator creation, torch at process-group creation.
NCCL_ENV = {"TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "NCCL_NVLS_ENABLE": "0"}


def apply_nccl_env(environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """Set :data:`NCCL_ENV` where the environment does not name the variable; returns what applies."""
    for key, value in NCCL_ENV.items():
        environ.setdefault(key, value)
    return {key: environ[key] for key in NCCL_ENV}


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


def _reset_training_state() -> None:
    reset_writer()
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _ports_to_keep(metrics_port: int, s3: S3TierConfig, store_ports: list[int]) -> list[int]:
    """Connections that outlive an incarnation: rendezvous stores, the exporter, the object store."""
    ports = [*store_ports, int(os.environ.get("MASTER_PORT", "0")), metrics_port]
    endpoint = s3.endpoint_url
    if endpoint:
        parsed = urlsplit(endpoint)
        ports.append(parsed.port or (443 if parsed.scheme == "https" else 80))
    return ports


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports no socket on this host holds now (all bound at once, so distinct)."""
    probes = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("", 0))
        return [int(probe.getsockname()[1]) for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def _store_ports(ipc_store_port: int | None, host: str, rank: int, timeout: datetime.timedelta) -> tuple[int, int]:
    """The Wrapper's store port and the process groups' store port.

    A configured ``store_port`` wins (and +1). Under torchrun or ft_launcher, rank 0 picks two
    free ports and hands them to the others through the launcher's own store: MASTER_PORT+2 is
    an ephemeral port that another job's connection may hold (a CI run met EADDRINUSE there).
    Without a launcher store, MASTER_PORT+2 and +3 are the only ports every rank can agree on.
    """
    if ipc_store_port:
        return ipc_store_port, ipc_store_port + 1
    master_port = int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return master_port + 2, master_port + 3
    agent = dist.TCPStore(host, master_port, is_master=False, timeout=timeout)
    # One key per launcher round: the store outlives the round's ranks.
    key = f"pretrain/inprocess-ports/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if rank == 0:
        agent.set(key, " ".join(str(port) for port in _free_ports(2)))
    wrapper_port, groups_port = (int(p) for p in agent.get(key).decode().split())
    return wrapper_port, groups_port


def _freeze_long_lived_objects() -> None:
    """Keep modules out of the collections a restart runs.

    Tearing an incarnation down runs full garbage collections (ours and the Wrapper's, which
    loops until nothing is left); each one traverses every object in the process, torch's and
    Megatron's modules included, ~0.3 s here per pass. Objects frozen now are never traversed;
    reference counting still frees them.
    """
    import megatron.core.dist_checkpointing  # noqa: F401  (imported here to be frozen)
    import megatron.core.models.gpt  # noqa: F401

    import pretrain.model  # noqa: F401

    gc.collect()
    gc.freeze()


def _backend() -> tuple[bool, str]:
    """(CUDA?, the backend): on CUDA, NCCL with NVRx's environment for in-process restart (a value
    the launcher set is kept, and said)."""
    cuda = torch.cuda.is_available()
    if cuda:
        applied = apply_nccl_env(os.environ)
        if applied != NCCL_ENV:
            log.warning("in-process restart on NCCL with %s set by the launcher (NVRx wants %s)", applied, NCCL_ENV)
    return cuda, "nccl" if cuda else "gloo"


def run_inprocess(cfg: Config, body: Callable[[], Any]) -> Any:
    """Run ``body`` (one attempt, process group already up) under the in-process Wrapper."""

    class ResetTrainingState(inprocess.finalize.Finalize):
        """Plain (unthreaded) finalize: Megatron parallel state and process groups down."""

        def __call__(self, state: Any) -> Any:
            _reset_training_state()
            return state

    class AbortIncarnationConnections(inprocess.abort.Abort):
        """Fail this incarnation's gloo collectives in flight (see ``collective_abort``)."""

        def __call__(self, state: Any) -> Any:
            connections.shut_down()
            return state

    ipc = cfg.fault_tolerance.inprocess
    host = os.environ["MASTER_ADDR"]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    wrapper_port, groups_port = _store_ports(ipc.store_port, host, rank, _seconds(ipc.barrier_timeout))
    keep = _ports_to_keep(cfg.metrics.port, cfg.checkpoint.s3, [wrapper_port, groups_port])
    connections = IncarnationConnections(keep_ports=keep)
    # The store the process groups rendezvous on: made once, a fresh prefix per incarnation.
    pg_store = dist.TCPStore(
        host, groups_port, world, is_master=rank == 0, timeout=_seconds(ipc.barrier_timeout), wait_for_workers=False
    )
    cuda, backend = _backend()
    wrapper = inprocess.Wrapper(
        store_kwargs={"port": wrapper_port, "timeout": _seconds(ipc.barrier_timeout)},
        # Compose applies right to left: NCCL's abort first, then gloo's connections.
        abort=inprocess.Compose(AbortIncarnationConnections(), inprocess.abort.AbortTorchDistributed()),
        finalize=ResetTrainingState(),
        # Drains the failed incarnation's kernels and finds a sticky CUDA error (no-op without CUDA).
        health_check=inprocess.health_check.CudaHealthCheck(timeout=_seconds(ipc.cuda_health_timeout)),
        monitor_thread_interval=_seconds(ipc.monitor_interval),
        monitor_process_interval=_seconds(ipc.monitor_interval),
        heartbeat_interval=_seconds(ipc.monitor_interval),
        progress_watchdog_interval=_seconds(ipc.monitor_interval),
        last_call_wait=_seconds(ipc.last_call_wait),
        soft_timeout=_seconds(ipc.soft_timeout),
        hard_timeout=_seconds(ipc.hard_timeout),
        heartbeat_timeout=_seconds(ipc.heartbeat_timeout),
        barrier_timeout=_seconds(ipc.barrier_timeout),
        completion_timeout=_seconds(ipc.barrier_timeout),
    )

    _freeze_long_lived_objects()

    def one_incarnation(call_wrapper: inprocess.CallWrapper | None = None) -> Any:
        iteration = call_wrapper.iteration if call_wrapper is not None else 0
        os.environ[INCARNATION_ENV] = str(iteration)
        if iteration:
            # The Wrapper has collected the failed incarnation's garbage: what is left lives on.
            gc.freeze()
            log.warning("in-process restart %d: rebuilding the process group", iteration)
        store = dist.PrefixStore(f"incarnation-{iteration}", pg_store)
        connections.mark()
        select_rank_device()  # NCCL binds to the current device: this rank's GPU, not cuda:0
        dist.init_process_group(
            backend,
            store=store,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            # A backstop only: a fault aborts collectives in flight at once (NCCL by the
            # Wrapper's abort, gloo by shutting this incarnation's connections).
            timeout=_seconds(ipc.group_timeout(cuda)),
        )
        # On a fault the Wrapper's finalize tears the state down; doing it here first would
        # delay the fault's report to the peers by the teardown.
        result = body()
        _reset_training_state()
        return result

    # The Wrapper finds the parameter to fill by its annotation's class; with postponed
    # annotations it would see a string.
    one_incarnation.__annotations__ = {"call_wrapper": inprocess.CallWrapper, "return": Any}
    return wrapper(one_incarnation)()

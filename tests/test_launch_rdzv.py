"""``pretrain launch``'s ``--rdzv-conf`` read by the launchers that run it.

NVRx 0.4.1 (installed here) parses the argv with its own parser and ``config_from_args``, builds
``RendezvousParameters`` from the rdzv config, and node 0 creates its real c10d TCP store from it:
the store's timeout is ``RDZV_STORE_TIMEOUT``, and 0.7's key is carried without complaint. NVRx 0.7
cannot be installed on this Python; its expectation is written down from its sources below.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pytest
from nvidia_resiliency_ext.fault_tolerance._torch_elastic_compat.rendezvous import RendezvousParameters
from nvidia_resiliency_ext.fault_tolerance._torch_elastic_compat.rendezvous.c10d_rendezvous_backend import (
    create_backend,
)
from nvidia_resiliency_ext.fault_tolerance._torch_elastic_compat.rendezvous.utils import _parse_rendezvous_config
from nvidia_resiliency_ext.fault_tolerance.launcher import config_from_args, get_args_parser

from pretrain.commands.launch import (
    LaunchPlan,
    ft_launcher_argv,
    launch,
    plan_from_env,
    refuse_pickling_rendezvous,
)
from pretrain.errors import LaunchError
from tests.helpers import FT_CPU, TINY, free_port

WAIT_S = 3600


def _argv(node_rank: int, port: int) -> list[str]:
    plan = LaunchPlan("kubernetes", node_rank, 4, f"127.0.0.1:{port}", f"n{node_rank}", "d", "/nvme", "r", 0, WAIT_S)
    return ft_launcher_argv(plan, str(TINY), 8, 3, str(FT_CPU), "ft_launcher", [])


def _parameters_041(argv: list[str]) -> RendezvousParameters:
    """What NVRx 0.4.1's ft_launcher makes of the argv (its launcher.py main path, minus running)."""
    args = get_args_parser().parse_args(argv[1:])
    config, _, _ = config_from_args(args)
    return RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )


def test_nvrx_041_serves_the_store_with_the_configured_wait_and_tolerates_07s_key() -> None:
    port = free_port()
    host = _parameters_041(_argv(0, port))
    assert host.get_as_bool("is_host") is True and host.get_as_int("read_timeout") == WAIT_S
    assert host.get_as_int("join_timeout") == WAIT_S
    backend, store = create_backend(host)  # node 0's real TCP store, as the 0.4.1 launcher builds it
    try:
        assert store.timeout == timedelta(seconds=WAIT_S)
        store.set("probe", b"1")
        assert store.get("probe") == b"1" and backend.name == "c10d"
    finally:
        del backend, store
    other = _parameters_041(_argv(2, port))
    assert other.get_as_bool("is_host") is False and other.get_as_int("read_timeout") == WAIT_S


def test_nvrx_07_reads_store_connect_wait_seconds_from_the_rdzv_conf() -> None:
    """NVIDIA/nvidia-resiliency-ext v0.7.0: ``src/nvidia_resiliency_ext/fault_tolerance/launcher.py``
    ~1366-1368 sets ``rdzv_configs["store_connect_wait_seconds"] = 120`` when the key is absent, and
    ``c10d_monkey_patch.py`` ~156-164 makes a non-host probe the store for at most that many seconds
    (``int(params.config["store_connect_wait_seconds"])``) before raising ``TimeoutError``. So the
    key must be in ``--rdzv-conf``, as an integer, on every node; 0.7 parses ``--rdzv-conf`` with the
    same ``<key>=<value>,...`` parser as 0.4.1 (``_parse_rendezvous_config``)."""
    for node_rank in (0, 1, 3):
        conf_arg = next(a for a in _argv(node_rank, 29500) if a.startswith("--rdzv-conf="))
        conf = _parse_rendezvous_config(conf_arg.split("=", 1)[1])
        assert int(conf["store_connect_wait_seconds"]) == WAIT_S, conf
        assert int(conf["is_host"]) == (1 if node_rank == 0 else 0)


def test_the_runbook_names_both_keys() -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "runbook.md").read_text()
    assert "store_connect_wait_seconds=...,read_timeout=..." in text


def _k8s_env(nvme: Path, nnodes: int, **extra: str) -> dict[str, str]:
    host = {"HOSTNAME": "pretrain-1", "NNODES": str(nnodes), "RDZV_HOST": "pretrain-0.p", "LOCAL_NVME": str(nvme)}
    return {**host, **extra}


def test_a_multi_node_launch_on_a_pickling_nvrx_is_refused_unless_the_network_is_private(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Security F1: NVRx 0.4.1 (installed) pickle.loads the rendezvous state from node 0's store.
    The refusal comes before exec; a dry run prints it and goes on (the sbatch's stop check)."""
    sets = [f"run.dir={tmp_path / 'runs'}", "data.global_batch_size=192"]
    launcher = str(Path(sys.executable).with_name("ft_launcher"))
    with pytest.raises(LaunchError) as err:
        launch(str(TINY), 1, 1, str(FT_CPU), False, sets, env=_k8s_env(tmp_path, 2), launcher=launcher)
    line = str(err.value)
    assert "nvidia-resiliency-ext 0.4.1 unpickles the rendezvous state" in line and "\n" not in line
    assert "fix: install nvidia-resiliency-ext>=0.7" in line and "RDZV_PRIVATE_NETWORK=1" in line
    assert launch(str(TINY), 1, 1, str(FT_CPU), True, sets, env=_k8s_env(tmp_path, 2), launcher=launcher) == 0
    assert f"# a launch would be refused: {line}" in capsys.readouterr().out

    env = _k8s_env(tmp_path, 2)
    plan = plan_from_env(env)
    assert refuse_pickling_rendezvous(plan, {**env, "RDZV_PRIVATE_NETWORK": "1"}) is None
    assert refuse_pickling_rendezvous(plan, env, version="0.7.0") is None
    one = _k8s_env(tmp_path, 1, HOSTNAME="pretrain-0")
    assert refuse_pickling_rendezvous(plan_from_env(one), one) is None, "one node keeps working on 0.4.1"

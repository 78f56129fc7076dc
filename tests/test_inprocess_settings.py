"""In-process restart's timeouts and NCCL settings in NVRx's order (issue 45, finding 2): on NCCL
the groups' timeout outlasts the Wrapper's hard timeout (NVRx: a watchdog that fires first
terminates the process, so no in-process restart happens), gloo's stays below it; the NCCL
variables NVRx's usage guide asks for are set unless the launcher set them."""

from __future__ import annotations

import pytest

from pretrain.config import load_config, validate
from pretrain.errors import ConfigError
from pretrain.resilience.inprocess import NCCL_ENV, apply_nccl_env
from tests.helpers import TINY

ON = "fault_tolerance.inprocess.enabled=true"


def test_the_shipped_defaults_are_in_nvrx_order() -> None:
    ipc = load_config(TINY, [ON]).fault_tolerance.inprocess
    validate(load_config(TINY, [ON]), 1, cuda=False)
    assert ipc.soft_timeout < ipc.hard_timeout < ipc.nccl_timeout and ipc.collective_timeout < ipc.hard_timeout
    assert ipc.group_timeout(cuda=True) == ipc.nccl_timeout == 150.0
    assert ipc.group_timeout(cuda=False) == ipc.collective_timeout == 60.0


@pytest.mark.parametrize(
    "overrides",
    [
        ["fault_tolerance.inprocess.nccl_timeout=90"],  # equal to hard_timeout: the watchdog may win
        ["fault_tolerance.inprocess.nccl_timeout=60"],  # the old rule's shape: NCCL below hard_timeout
        ["fault_tolerance.inprocess.collective_timeout=120"],  # gloo backstop after the hard timeout
        ["fault_tolerance.inprocess.cuda_health_timeout=0"],
    ],
)
def test_timeouts_out_of_order_are_refused_with_the_values(overrides: list[str]) -> None:
    cfg = load_config(TINY, [ON, *overrides])
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1, cuda=False)
    text = str(err.value)
    assert "fault_tolerance.inprocess" in text and "hard_timeout < nccl_timeout" in text and "fix:" in text
    assert "\n" not in text


def test_out_of_order_timeouts_are_fine_while_inprocess_is_off() -> None:
    validate(load_config(TINY, ["fault_tolerance.inprocess.nccl_timeout=10"]), 1, cuda=False)


def test_nccl_env_is_set_where_the_launcher_left_it_unset() -> None:
    environ: dict[str, str] = {"PATH": "/bin"}
    assert apply_nccl_env(environ) == NCCL_ENV
    assert environ == {"PATH": "/bin", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "NCCL_NVLS_ENABLE": "0"}


def test_a_launcher_setting_wins_and_is_reported() -> None:
    environ = {"NCCL_NVLS_ENABLE": "1"}
    applied = apply_nccl_env(environ)
    assert applied == {"TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "NCCL_NVLS_ENABLE": "1"}
    assert applied != NCCL_ENV

"""In-process restart's timeouts and NCCL settings in NVRx's order (issue 45, finding 2): on NCCL
the groups' timeout outlasts the Wrapper's hard timeout (NVRx: a watchdog that fires first
terminates the process, so no in-process restart happens), gloo's stays below it; the NCCL
variables NVRx's usage guide asks for are set unless the launcher set them. Lazy gloo connections
(issue 45 #13) only where in-process restart is off."""

from __future__ import annotations

import logging

import pytest

from pretrain.config import load_config, validate
from pretrain.errors import ConfigError
from pretrain.resilience.inprocess import NCCL_ENV, apply_nccl_env
from pretrain.train import GLOO_LAZY_INIT, gloo_lazy_init
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


@pytest.mark.parametrize(
    ("cuda", "inprocess", "lazy"),
    [
        (True, False, True),  # NCCL without in-process restart: pairs connect at first use
        (True, True, False),  # under NVRx's Wrapper: full mesh (lazy gloo aborted in 2 of 7 runs)
        (False, False, False),  # CPU: the default group is gloo already, left as torch makes it
        (False, True, False),
    ],
)
def test_gloo_connects_lazily_on_cuda_only_without_inprocess_restart(cuda: bool, inprocess: bool, lazy: bool) -> None:
    environ: dict[str, str] = {"PATH": "/bin"}
    assert gloo_lazy_init(environ, cuda, inprocess) is lazy
    assert environ == ({"PATH": "/bin", GLOO_LAZY_INIT: "1"} if lazy else {"PATH": "/bin"})


def test_a_launchers_lazy_gloo_under_inprocess_restart_is_kept_and_warned(caplog: pytest.LogCaptureFixture) -> None:
    environ = {GLOO_LAZY_INIT: "1"}
    with caplog.at_level(logging.WARNING, logger="pretrain"):
        assert gloo_lazy_init(environ, cuda=True, inprocess=True) is True
    assert environ == {GLOO_LAZY_INIT: "1"}
    assert any(GLOO_LAZY_INIT in r.getMessage() and "fix:" in r.getMessage() for r in caplog.records)
    environ = {GLOO_LAZY_INIT: "0"}
    assert gloo_lazy_init(environ, cuda=True, inprocess=False) is False and environ == {GLOO_LAZY_INIT: "0"}

"""pretrain/platform/compat.py on the installed megatron-core (0.16.1 here; the newest release is checked on
the GPU machine by scripts/gpu-check.sh): the background dist-checkpoint save runs on Megatron's
own queue, the writer's Manager starts through whichever getter the version has, and the
memory-efficient fully-reshardable gather is used where the installed code reads its flag."""

from __future__ import annotations

import inspect
import types

import pytest
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async

from pretrain.optim import sharding_metadata
from pretrain.platform.compat import (
    MEM_EFFICIENT_KEY,
    accepts_keyword,
    async_save_kwargs,
    fully_reshardable_mem_efficient,
    megatron_core_version,
    reset_write_results_queue,
    warm_write_results_queue,
    write_results_queue_getter,
)


def test_async_save_kwargs_match_the_installed_save_signature() -> None:
    has_strategy = "async_strategy" in inspect.signature(dist_checkpointing.save).parameters
    assert async_save_kwargs() == ({"async_strategy": "mcore"} if has_strategy else {})
    if megatron_core_version() == "0.16.1":
        assert async_save_kwargs() == {}  # 0.16.1 has Megatron's queue only


def test_accepts_keyword_reads_named_parameters_only() -> None:
    def newer(sharded_state_dict, checkpoint_dir, async_sharded_save=False, async_strategy="nvrx"):  # noqa: ANN001, ANN202
        return None

    def catch_all(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        return None

    assert accepts_keyword(newer, "async_strategy")
    assert not accepts_keyword(catch_all, "async_strategy")


def test_write_results_queue_getter_per_version() -> None:
    getter = write_results_queue_getter()
    assert getter.__module__ == filesystem_async.__name__
    if megatron_core_version() == "0.16.1":
        assert getter.__name__ == "_get_write_results_queue"
    newer = types.ModuleType("filesystem_async_0_19")
    newer.get_write_results_queue = lambda mp_mode="spawn": mp_mode  # the 0.19 name
    assert write_results_queue_getter(newer)() == "spawn"


def test_a_version_with_neither_getter_fails_in_one_line() -> None:
    with pytest.raises(RuntimeError, match=r"fix: install a megatron-core between 0.16.1 and 0.19.x") as exc:
        write_results_queue_getter(types.ModuleType("filesystem_async_future"))
    assert "\n" not in str(exc.value)


def test_the_writer_manager_starts_once() -> None:
    warm_write_results_queue()
    first = filesystem_async._results_queue
    try:
        assert first is not None
        warm_write_results_queue()
        assert filesystem_async._results_queue is first
    finally:
        # The Manager is a process-lifetime singleton in a rank; here it must not outlive the test.
        if first is not None:
            first._manager.shutdown()
        reset_write_results_queue()


class _NoMemEfficient:
    """A DistributedOptimizer before the flag: its fully-reshardable state reads the sharding type only."""

    def sharded_param_state_fully_reshardable(self, model_sd: dict, is_loading: bool = False, metadata: dict = None):  # noqa: ANN201, RUF013
        return metadata.get("distrib_optim_sharding_type")

    def get_parameter_state_dp_zero(self, use_gloo_comm: bool = True, empty_data: bool = False):  # noqa: ANN201
        return None


class _FlagWithoutDpZeroOnly(_NoMemEfficient):
    """Reads the flag, but its gather cannot return on DP rank 0 alone."""

    def sharded_param_state_fully_reshardable(self, model_sd: dict, is_loading: bool = False, metadata: dict = None):  # noqa: ANN201, RUF013
        return metadata.get("distrib_optim_fully_reshardable_mem_efficient", False)


def test_the_mem_efficient_gather_is_found_by_feature_in_the_installed_megatron() -> None:
    """Issue 45 #4: megatron-core 0.16.1 (here) and 0.19 both read the flag (read in their sources);
    detection reads the installed code, never the version string."""
    assert fully_reshardable_mem_efficient(), f"megatron-core {megatron_core_version()} reads {MEM_EFFICIENT_KEY}"
    assert not fully_reshardable_mem_efficient(_NoMemEfficient)
    assert not fully_reshardable_mem_efficient(_FlagWithoutDpZeroOnly)


@pytest.mark.parametrize(
    ("kind", "mem_efficient", "expected"),
    [
        ("reshardable", True, {"distrib_optim_sharding_type": "fully_reshardable", MEM_EFFICIENT_KEY: True}),
        ("reshardable", False, {"distrib_optim_sharding_type": "fully_reshardable"}),
        ("local", True, {"distrib_optim_sharding_type": "dp_reshardable"}),  # tier 1: no gather at all
        ("local", False, {"distrib_optim_sharding_type": "dp_reshardable"}),
    ],
)
def test_reshardable_saves_ask_for_the_mem_efficient_gather_where_offered(
    kind: str, mem_efficient: bool, expected: dict
) -> None:
    assert sharding_metadata(kind, mem_efficient) == expected

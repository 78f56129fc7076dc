"""Megatron Core API differences between the versions the project runs on, in one place.

Checked against the sources of megatron-core 0.16.1 (the CPU machines and CI) and 0.19.2 (the
newest release, the GPU containers). Everything else the project calls kept its signature
between them (``scripts/gpu-check.sh`` runs the GPU checks on the newest release):

* ``dist_checkpointing.save(..., async_sharded_save=True)``: 0.19 added ``async_strategy`` with
  the default ``"nvrx"`` (NVRx's own async queue and request types); the project schedules the
  request on Megatron's ``AsyncCallsQueue`` (a forked writer per save, copy-on-write snapshot),
  which is ``async_strategy="mcore"`` there and the only behaviour 0.16.1 has.
  :func:`async_save_kwargs` returns what to pass.
* The checkpoint writer's multiprocessing Manager, warmed up at start-up: 0.16.1 names its getter
  ``filesystem_async._get_write_results_queue``, 0.19 ``get_write_results_queue``.
  :func:`warm_write_results_queue` calls whichever exists; both keep the queue in the module's
  ``_results_queue``, which it then wraps to hold bytes (:mod:`pretrain.platform.bytes_queue`).
* The memory-efficient fully-reshardable optimizer gather (metadata
  ``distrib_optim_fully_reshardable_mem_efficient``: a gloo gather to DP rank 0 only, instead of an
  NCCL all-gather of the whole model-parallel shard's fp32 state onto every DP rank's GPU and
  host): read by ``DistributedOptimizer.sharded_param_state_fully_reshardable`` in 0.16.1 and 0.19.
  :func:`fully_reshardable_mem_efficient` detects it in the installed code, not by version.
* The core-attention call: 0.19 forwards extra keyword arguments to a custom core attention
  (``core_attention_extra_kwargs``); :class:`pretrain.model.SDPACoreAttention` accepts and ignores
  them.

NVRx's straggler detector (``Detector``, ``Report``) has the same code in 0.4.1 (the CPU machines)
and 0.7 but moved from ``nvidia_resiliency_ext.straggler`` to
``nvidia_resiliency_ext.attribution.straggler`` (NVRx commit 330d929 "Moving straggler module to
`attribution`"); :func:`straggler_module` imports whichever exists.

A getter missing from both is a one-line error naming the installed version and the fix.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import inspect
import queue
from types import ModuleType
from typing import Any

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from pretrain.platform.bytes_queue import BytesQueue

MEM_EFFICIENT_KEY = "distrib_optim_fully_reshardable_mem_efficient"


@functools.cache
def megatron_core_version() -> str:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def accepts_keyword(func: Any, name: str) -> bool:
    """Whether ``func`` takes a keyword argument ``name`` (a named parameter, not ``**kwargs``)."""
    try:
        return name in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False


def reads_key(func: Any, key: str) -> bool:
    """Whether ``func``'s source names the string ``key`` (a metadata key it reads); False where the
    installed package ships no source."""
    try:
        source = inspect.getsource(func)
    except (OSError, TypeError):
        return False
    return f"'{key}'" in source or f'"{key}"' in source


def fully_reshardable_mem_efficient(optimizer_class: Any = DistributedOptimizer) -> bool:
    """Whether the installed DistributedOptimizer offers the memory-efficient fully-reshardable
    gather: its fully-reshardable state reads :data:`MEM_EFFICIENT_KEY` and its DP-0 gather can
    return on DP rank 0 alone (``return_on_all_ranks``)."""
    return reads_key(optimizer_class.sharded_param_state_fully_reshardable, MEM_EFFICIENT_KEY) and accepts_keyword(
        optimizer_class.get_parameter_state_dp_zero, "return_on_all_ranks"
    )


@functools.cache
def async_save_kwargs() -> dict[str, str]:
    """Keyword arguments for ``dist_checkpointing.save(..., async_sharded_save=True)`` so that the
    request it returns runs on Megatron's own ``AsyncCallsQueue`` on every supported version."""
    return {"async_strategy": "mcore"} if accepts_keyword(dist_checkpointing.save, "async_strategy") else {}


def write_results_queue_getter(module: Any = filesystem_async) -> Any:
    """The function that creates (once) the checkpoint writer's results queue and its Manager."""
    for name in ("get_write_results_queue", "_get_write_results_queue"):
        getter = getattr(module, name, None)
        if callable(getter):
            return getter
    raise RuntimeError(
        f"megatron-core {megatron_core_version()}: {module.__name__} has neither get_write_results_queue nor "
        "_get_write_results_queue; fix: install a megatron-core between 0.16.1 and 0.19.x "
        "or extend pretrain/platform/compat.py"
    )


def warm_write_results_queue() -> None:
    """Start the writer's multiprocessing Manager now (its first save would otherwise pay for it),
    created as the installed Megatron creates it, then wrapped so that it holds pickled bytes
    (:mod:`pretrain.platform.bytes_queue`: the Manager never imports torch)."""
    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    write_results_queue_getter()()
    filesystem_async._results_queue = BytesQueue(filesystem_async._results_queue)


def drain_write_results() -> None:
    """Drop what writers left in the results queue (one per process, shared by every save): after
    a save was abandoned, a writer that finished put its results there, and the next save's
    finalize would read them as its own (stale offsets in ``.metadata``). No queue yet: nothing."""
    results = getattr(filesystem_async, "_results_queue", None)
    if results is None:
        return
    stored = results.inner if isinstance(results, BytesQueue) else results  # dropped unread: no unpickling
    with contextlib.suppress(queue.Empty, OSError, EOFError):  # empty, or its Manager is gone
        while True:
            stored.get_nowait()


def reset_write_results_queue() -> None:
    """Forget the writer's Manager (after an in-process restart its process is gone)."""
    filesystem_async._results_queue = None


STRAGGLER_MODULES = ("nvidia_resiliency_ext.attribution.straggler", "nvidia_resiliency_ext.straggler")


@functools.cache
def straggler_module() -> ModuleType:
    """NVRx's straggler package (``Detector``, ``Report``, ``StragglerId``) at its 0.7 or 0.4 path."""
    for name in STRAGGLER_MODULES:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not name.startswith(exc.name):
                raise  # the package exists but something it imports is missing: not a version difference
    raise RuntimeError(
        f"nvidia-resiliency-ext: neither {' nor '.join(STRAGGLER_MODULES)} can be imported; "
        "fix: install nvidia-resiliency-ext >= 0.4 or extend pretrain/platform/compat.py"
    )

"""``torch.compile`` that compiles at the first call, installed before Megatron Core is imported.

Megatron Core wraps its fused kernels (bias+GeLU, bias+SwiGLU, ...) in ``torch.compile`` as its
modules are imported. Decorating is not free: it imports TorchDynamo and TorchInductor, ~3 s of CPU
per rank process on this project's CPU hosts (5.2-5.9 s against 8.2-9.1 s of user time to import
the trainer, measured side by side), paid again by every restarted rank even where the fused
kernels never run (the CPU spec does not use them). torch.compile itself compiles only at the
first call, so deferring the decoration to that call changes nothing else: the same function is
compiled with the same arguments the first time it runs.

Owns :func:`defer_torch_compile`, which the verbs that import Megatron (``pretrain train``,
``evaluate``, ``prepare-data``, ``merge-data``: ``pretrain/cli.py``) call before they import anything
from it. Never compiles anything
itself and never changes a compile's arguments.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

_eager_compile = torch.compile


def _compile_at_first_call(model: Callable[..., Any] | None = None, **options: Any) -> Any:
    if model is None:  # used as ``@torch.compile(...)``: the decorator that receives the function
        return lambda fn: _compile_at_first_call(fn, **options)
    if not callable(model) or isinstance(model, torch.nn.Module):
        return _eager_compile(model, **options)  # modules keep torch's OptimizedModule wrapper
    compiled: Callable[..., Any] | None = None

    @functools.wraps(model)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            compiled = _eager_compile(model, **options)
        return compiled(*args, **kwargs)

    return call


def defer_torch_compile() -> None:
    """Make ``torch.compile`` of a function lazy for the rest of this process (idempotent)."""
    torch.compile = _compile_at_first_call  # type: ignore[assignment]

"""CUDA-less shims for Megatron Core on CPU hosts (gloo).

Megatron Core 0.16 assumes CUDA in a few places that are otherwise device-agnostic:

* ``dist_checkpointing`` calls ``torch.cuda.synchronize()`` around saves and loads;
* the grad buffers and checkpoint loaders allocate on ``torch.cuda.current_device()``;
* ``pipeline_parallel.schedules`` allocates its token counter with ``device="cuda"``.

``install()`` patches exactly these, and only when no CUDA device exists: on a GPU host it
returns without touching anything, so the same training code runs CUDA/NCCL there. Keep every
CPU-only workaround in this module so that it stays auditable.
"""

from __future__ import annotations

import types
from typing import Any

import torch

_installed = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


class _CpuDeviceTorch(types.ModuleType):
    """A view of the ``torch`` module whose ``zeros`` maps ``device="cuda"`` to the CPU.

    Installed as ``schedules.torch`` only, so the rest of the process sees the real ``torch``.
    """

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)


def install() -> bool:
    """Apply the CPU shims once. Returns True if they are active (no CUDA on this host)."""
    global _installed
    if cuda_available():
        return False
    if _installed:
        return True
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]

    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _CpuDeviceTorch()  # type: ignore[attr-defined]
    _installed = True
    return True

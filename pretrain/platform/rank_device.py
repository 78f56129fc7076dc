"""Which GPU this rank uses: ``LOCAL_RANK`` (set by torchrun/ft_launcher), selected before NCCL starts.

Owns the choice and the ``torch.cuda.set_device`` call only. Called by :func:`pretrain.train.train`
and :func:`pretrain.commands.evaluate.evaluate`
before any process group exists (plain runs and in-process restarts alike) and again by
:mod:`pretrain.resilience.inprocess` in every incarnation before its ``init_process_group``:
NCCL binds a communicator to the current device, and a thread that never chose one is on cuda:0.
Never called on a CPU-only host (no device to choose).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch


def rank_device_index(env: Mapping[str, str], device_count: int) -> int | None:
    """The CUDA device index for this rank, or None without a visible GPU. A ``LOCAL_RANK`` past
    the visible devices is a one-line error (NCCL would otherwise put two ranks on one GPU)."""
    if device_count == 0:
        return None
    raw = env.get("LOCAL_RANK", "0")
    try:
        index = int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={raw!r} is not an integer; fix: launch with torchrun or ft_launcher") from None
    if not 0 <= index < device_count:
        raise ValueError(
            f"LOCAL_RANK={index} but {device_count} GPU(s) visible; fix: --nproc-per-node at most the GPUs per "
            "node, and CUDA_VISIBLE_DEVICES listing one GPU per local rank"
        )
    return index


def select_rank_device() -> int | None:
    """Make this rank's GPU the current device of the calling thread; returns its index."""
    index = rank_device_index(os.environ, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if index is not None:
        torch.cuda.set_device(index)
    return index

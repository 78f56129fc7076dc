"""The data-parallel-replicated model state, saved once per DP group (issue 45 #10): each DP rank's
per-rank payload (tiers 0-2) holds a slice of every model tensor, and a restore all-gathers them.

Every DP rank of a model-parallel position holds the same weights, so tiers 0-2 stored them DP
times (at DP=16 the weights were 2.7x the rank's optimizer shard). :func:`split` keeps, of each
tensor flattened and padded to a multiple of DP, the ``1/DP`` piece at this rank's position, all
pieces of one dtype in one new buffer: a copy of the slice's elements only (``torch.save`` of a view
would write the whole tensor's storage). Non-tensor entries and ``_extra_state`` are kept whole.
:func:`gather` is collective over the DP group: one all-gather per dtype, then every tensor cut back
out of the DP buffers, bit for bit the tensor that was split. The same layout on every DP rank
(one model) puts each tensor at the same offset in every rank's buffer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

SPLIT_KEY = "model_split"  # the payload's key for a split model state (``model`` when DP is 1)


def split(model_state: dict[str, Any], dp: int, dp_rank: int) -> dict[str, Any]:
    """This DP rank's share of ``model_state``: ``{"dp", "dp_rank", "layout", "buffers", "other"}``;
    ``layout`` lists ``(key, shape, dtype name, piece length, offset)`` in the state's order."""
    layout: list[tuple[str, list[int], str, int, int]] = []
    other: dict[str, Any] = {}
    sizes: dict[str, int] = {}
    device: dict[str, torch.device] = {}
    for key, value in model_state.items():
        if not isinstance(value, torch.Tensor) or key.endswith("_extra_state"):
            other[key] = value  # kept whole: TE's extra state (FP8 metadata) is not known to match across DP
            continue
        name = str(value.dtype).removeprefix("torch.")
        piece = -(-value.numel() // dp)  # ceil: the last rank's piece is padded
        layout.append((key, list(value.shape), name, piece, sizes.get(name, 0)))
        sizes[name] = sizes.get(name, 0) + piece
        device.setdefault(name, value.device)
    buffers = {name: torch.zeros(size, dtype=getattr(torch, name), device=device[name]) for name, size in sizes.items()}
    for key, _shape, name, piece, offset in layout:
        flat = model_state[key].detach().reshape(-1)
        lo, hi = min(dp_rank * piece, flat.numel()), min((dp_rank + 1) * piece, flat.numel())
        buffers[name][offset : offset + hi - lo].copy_(flat[lo:hi])
    return {"dp": dp, "dp_rank": dp_rank, "layout": layout, "buffers": buffers, "other": other}


def gather(share: dict[str, Any], group: Any) -> dict[str, Any]:
    """Collective over the DP ``group`` (gloo; every DP rank with its own share of the same step):
    the whole model state again, on CPU."""
    dp = share["dp"]
    if dist.get_world_size(group) != dp or dist.get_rank(group) != share["dp_rank"]:
        raise RuntimeError(
            f"a model state split over DP {dp} (position {share['dp_rank']}) cannot be gathered at DP "
            f"{dist.get_world_size(group)} position {dist.get_rank(group)}; fix: restore it at its own topology"
        )
    gathered: dict[str, list[torch.Tensor]] = {}
    for name in sorted(share["buffers"]):  # the same order on every rank
        mine = share["buffers"][name].detach().cpu().contiguous()
        parts = [torch.empty_like(mine) for _ in range(dp)]
        dist.all_gather(parts, mine, group=group)
        gathered[name] = parts
    state: dict[str, Any] = {}
    for key, shape, name, piece, offset in share["layout"]:
        pieces = torch.cat([part[offset : offset + piece] for part in gathered[name]])
        numel = 1
        for dim in shape:
            numel *= dim
        state[key] = pieces[:numel].reshape(shape)
    state.update(share["other"])
    return state

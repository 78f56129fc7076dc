"""Issue 45 #10: tiers 0-2 keep the DP-replicated weights once per DP group. Two real gloo ranks
split a model state (fp32, bf16, int64, odd sizes, a tensor smaller than DP, a non-tensor entry),
each keeps about 1/DP of the bytes in buffers of its own (never a view of the live tensor: a
``torch.save`` of a view writes the whole storage), and the gather gives back every tensor bit for
bit; through ``torch.save``/``torch.load`` as tier 1 writes and maps them."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.checkpointing.dp_slices import gather, split
from tests.helpers import two_gloo_ranks


def _model_state() -> dict:
    gen = torch.Generator().manual_seed(7)
    return {
        "embedding.weight": torch.randn(101, 16, generator=gen),
        "layer.weight": torch.randn(33, 7, generator=gen).to(torch.bfloat16),
        "layer.bias": torch.randn(1, generator=gen),  # fewer elements than DP: one rank holds it, one padding
        "counter": torch.arange(5, dtype=torch.int64),
        "layer._extra_state": None,
        "norm._extra_state": torch.tensor([1, 2, 3], dtype=torch.uint8),  # TE's: kept whole, never split
    }


def _round_trip(tmp: str, rank: int, _out: Path) -> dict:
    state = _model_state()
    share = split(state, dist.get_world_size(), rank)
    path = Path(tmp) / f"share-{rank}.pt"
    torch.save(share, path)
    on_disk = path.stat().st_size
    back = gather(torch.load(path, weights_only=True, mmap=True), None)
    same = {k: (v is None and back[k] is None) or (torch.equal(v, back[k]) and v.dtype == back[k].dtype)
            for k, v in state.items()}  # fmt: skip
    live = {t.untyped_storage().data_ptr() for t in state.values() if isinstance(t, torch.Tensor)}
    shared = any(b.untyped_storage().data_ptr() in live for b in share["buffers"].values())
    whole = sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
    kept = sum(b.numel() * b.element_size() for b in share["buffers"].values())
    extra = share["other"]["norm._extra_state"].tolist()
    sizes = {"kept": kept, "whole": whole, "on_disk": on_disk}
    return {"same": same, "shared": shared, "keys": list(back), "extra": extra, **sizes}


def test_each_dp_rank_keeps_a_slice_and_the_gather_is_bit_exact(tmp_path: Path) -> None:
    rows = two_gloo_ranks(functools.partial(_round_trip, str(tmp_path)), tmp_path / "ranks")
    for row in rows:
        assert all(row["same"].values()), row["same"]
        assert sorted(row["keys"]) == sorted(_model_state())
        assert not row["shared"], "a share must own its bytes (a saved view would write the whole tensor)"
        assert row["kept"] <= row["whole"] // 2 + 64, row  # ~1/DP, plus the padding of odd sizes
        assert row["on_disk"] < row["whole"], row
        assert row["extra"] == [1, 2, 3]

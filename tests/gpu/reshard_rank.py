"""One rank of the reshard check: a reshardable checkpoint loaded on CPU (gloo) at TP=2.

``torchrun --nproc-per-node 2 -m tests.gpu.reshard_rank --mode cuda|cpu --checkpoint STEP_DIR --out result.json``

The checkpoint was written by the training run of :mod:`tests.gpu.train_driver` on one rank
(TP=1, DP=1; bf16 and Megatron's DistributedOptimizer on GPU). Each rank builds the same GPT at
TP=2 on the CPU, asks Megatron's ``dist_checkpointing.load`` for its shards of every tensor the
checkpoint holds (the model's, and each optimizer tensor keyed to a model tensor: fp32 master
weights, Adam moments), in the checkpoint's dtype, and compares every shard with the same slice
of the full tensor read independently (``torch.distributed.checkpoint``'s ``dcp_to_torch_save``).
Rank 0 writes the result: tensors compared and equal, per kind, and any key left unread.
Run with ``CUDA_VISIBLE_DEVICES=""`` on a GPU host: the load is the CPU path.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from pretrain.config import padded_vocab_size
from pretrain.model import build_model, transformer_config
from pretrain.platform import cpu_shims
from pretrain.rank_state import seed_everything
from tests.gpu.train_driver import config

TP = 2
CPU_MODEL = ["model.precision=fp32", "model.spec=local", "parallel.distributed_optimizer=off", f"parallel.tp={TP}"]


def full_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, unsharded, read by torch alone (no Megatron code)."""
    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "full.pt"
        dcp_to_torch_save(str(model_dir), str(out))
        loaded = torch.load(out, weights_only=False)
    return {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}


def targets(model_sd: dict[str, Any], saved: dict[str, Any]) -> dict[str, ShardedTensor]:
    """This rank's shard of every checkpoint tensor keyed to a model tensor, in the saved dtype.
    A key may have several shards here (one per layer, stacked along a prepended axis)."""
    by_key: dict[str, list[ShardedTensor]] = {}
    for sh in nested_values(model_sd):
        if isinstance(sh, ShardedTensor):
            by_key.setdefault(sh.key, []).append(sh)
    out: dict[str, ShardedTensor] = {}
    for key, meta in saved.items():
        model_key = key if key in by_key else next((k for k in by_key if key.endswith("." + k)), None)
        if model_key is None or tuple(meta.global_shape) != tuple(by_key[model_key][0].global_shape):
            continue
        for sh in by_key[model_key]:
            data = torch.empty(sh.local_shape, dtype=meta.dtype)
            out[f"{key}@{sh.global_offset}"] = dataclasses.replace(sh, key=key, data=data, dtype=meta.dtype)
    return out


def compare(loaded: dict[str, Any], wanted: dict[str, ShardedTensor], full: dict[str, torch.Tensor]) -> dict[str, Any]:
    equal, differ = [], []
    for name, sh in wanted.items():
        expected = full[sh.key][sh.global_slice()].reshape(sh.local_shape)
        (equal if torch.equal(loaded[name], expected) else differ).append(name)
    return {"equal": equal, "differ": differ, "keys": sorted({sh.key for sh in wanted.values()})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["cuda", "cpu"], required=True, help="where the checkpoint was trained")
    parser.add_argument("--checkpoint", required=True, help="a published reshardable step directory")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    cpu_shims.install()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    rank = dist.get_rank()
    model_dir = Path(args.checkpoint) / "model"
    cfg = config(args.mode, Path(tempfile.gettempdir()), "reshard", CPU_MODEL)
    seed_everything(cfg.train.seed)
    model = build_model(cfg.model, padded_vocab_size(cfg), transformer_config(cfg.model, cfg.parallel))
    saved = dist_checkpointing.load_tensors_metadata(str(model_dir))
    wanted = targets(model.sharded_state_dict(), saved)
    loaded = dist_checkpointing.load(dict(wanted), str(model_dir))
    result = compare(loaded, wanted, full_tensors(model_dir))
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, {"rank": rank, **result})
    if rank == 0:
        report = {
            "layout": {"tp": TP, "dp": dist.get_world_size() // TP, "backend": "gloo", "device": "cpu"},
            "checkpoint": str(args.checkpoint),
            "checkpoint_tensors": len(saved),
            "unread_keys": sorted(set(saved) - set(result["keys"])),
            "per_rank": [
                {"rank": r["rank"], "compared": len(r["equal"]) + len(r["differ"]), "differ": r["differ"]}
                for r in results
            ],
            "optimizer_keys": sum(1 for k in result["keys"] if k.startswith("optimizer")),
            "model_keys": sum(1 for k in result["keys"] if not k.startswith("optimizer")),
        }
        report["all_equal"] = all(not r["differ"] and r["compared"] for r in report["per_rank"])
        Path(args.out).write_text(json.dumps(report, indent=1))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-rank state that a resume needs bit for bit: RNG streams and the data cursor.

Everything is converted to tensors and plain Python values so that it loads with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from megatron.core import tensor_parallel

from pretrain.data.sampler import SampleCursor


def capture_rng() -> dict[str, Any]:
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    rng: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": np_kind,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
        rng["cuda_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    version, state, gauss = rng["python"]
    random.setstate((version, tuple(state), gauss))
    n = rng["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available() and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["cuda_tracker"])


def seed_everything(seed: int) -> None:
    """Seed every stream; CUDA model-parallel streams through Megatron's tracker."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def rank_state(rank: int, topology: dict[str, int], cursor: SampleCursor) -> dict[str, Any]:
    return {"rank": rank, "topology": dict(topology), "rng": capture_rng(), "data_cursor": asdict(cursor)}

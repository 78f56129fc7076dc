"""A weighted blend of several prepared datasets, indexed so that resume stays exact.

Megatron's ``BlendedDataset`` sizes itself from the number of samples a run will draw (a change of
``train.steps`` would change which sample sits where). Here the blend is one fixed "blend epoch"
of ``sum(len(part))`` positions, assigned to the parts by Megatron's own greedy blending index
(``megatron.core.datasets.helpers.build_blending_indices``: at every position the part furthest
below its share), and position ``j`` of part ``i`` is its sample ``j mod len(part)``. The blend
depends only on the parts and the weights, so the resumable sampler (which permutes positions of
whatever dataset it is given, per epoch, keyed by the consumed-sample count) resumes bit-exactly,
and every window of positions follows the weights to within one sample per part.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from megatron.core.datasets.helpers import build_blending_indices


class BlendedSamples(torch.utils.data.Dataset):
    def __init__(self, parts: Sequence[torch.utils.data.Dataset], weights: Sequence[float]) -> None:
        total = float(sum(weights))
        self.parts = list(parts)
        self.weights = np.array([w / total for w in weights], dtype=np.float64)
        self.size = sum(len(p) for p in self.parts)
        self.part_index = np.zeros(self.size, dtype=np.int16)
        self.part_sample = np.zeros(self.size, dtype=np.int64)
        build_blending_indices(self.part_index, self.part_sample, self.weights, len(self.parts), self.size, False)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, position: int) -> dict[str, torch.Tensor]:
        part = self.parts[int(self.part_index[position])]
        sample = part[int(self.part_sample[position]) % len(part)]
        return {**sample, "dataset_id": torch.tensor(int(self.part_index[position]), dtype=torch.int64)}

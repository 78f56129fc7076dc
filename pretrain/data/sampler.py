"""The resumable global sample order: which dataset index each rank reads for each global batch, a
pure function of the seed and the global consumed-samples count (so a resume at any step, or at
another data-parallel size, skips and repeats nothing), and the cursor a rank saves.

Never: opens a dataset file or imports Megatron. The checkpoint state keeps a sampler and no longer
imports Megatron's dataset builder for it (it still imports Megatron through the tokenizer and the
optimizer).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset


@dataclass
class SampleCursor:
    """Where this rank is in the data stream; a pure function of the global consumed count."""

    consumed_samples: int
    dp_rank: int
    dp_size: int
    global_batch_size: int


class GlobalBatchSampler:
    """Deterministic sample order keyed by the global consumed-samples count.

    Global sample ``g`` is dataset index ``perm(g // N)[g % N]``, where each epoch's permutation
    is seeded by ``(seed, epoch)``. Each global batch ``[c, c + GB)`` is split into contiguous DP
    slices, so the set of samples per step does not depend on the DP size: resuming at another DP
    size skips and repeats nothing.
    """

    def __init__(
        self, num_samples: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int, seed: int
    ) -> None:
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    @property
    def per_rank(self) -> int:
        return self.global_batch_size // self.dp_size

    @property
    def num_microbatches(self) -> int:
        return self.per_rank // self.micro_batch_size

    def global_positions(self, consumed: int) -> range:
        """Global sample positions this rank takes in the batch starting at ``consumed``."""
        start = consumed + self.dp_rank * self.per_rank
        return range(start, start + self.per_rank)

    def dataset_index(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_samples)
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = rng.permutation(self.num_samples)
            self._perm_epoch = epoch
        return int(self._perm[offset])

    def microbatches(self, dataset: Dataset, consumed: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches for the global batch that starts at ``consumed``."""
        positions = list(self.global_positions(consumed))
        out = []
        for i in range(0, len(positions), self.micro_batch_size):
            samples = [dataset[self.dataset_index(p)] for p in positions[i : i + self.micro_batch_size]]
            batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
            batch["positions"] = torch.tensor(positions[i : i + self.micro_batch_size], dtype=torch.int64)
            out.append(batch)
        return out

    def cursor(self, consumed: int) -> SampleCursor:
        return SampleCursor(consumed, self.dp_rank, self.dp_size, self.global_batch_size)

"""Megatron ``GPTDataset``s over prepared indexed datasets (one prefix or a weighted blend), their
train/valid splits, and the resumable batch sampler."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from torch.utils.data import Dataset

from pretrain.config import DataConfig
from pretrain.data.blend import BlendedSamples
from pretrain.data.index_cache import cache_dirs, check_index_cache
from pretrain.data.prepare import checked_token_ids, dataset_snapshot_id
from pretrain.data.tokenizer import load_tokenizer
from pretrain.errors import DataError


def build_train_dataset(data: DataConfig, seed: int, seq_length: int, vocab_size: Callable[[], int]) -> Dataset:
    """One epoch of GPT training samples (shuffled by Megatron with ``train.seed``); epochs are ours."""
    return build_datasets(data, seed, seq_length, vocab_size)[0]


def _split_of(
    data: DataConfig, seed: int, seq_length: int, vocab_size: Callable[[], int], prefix: str
) -> tuple[GPTDataset, GPTDataset | None]:
    for suffix in (".bin", ".idx"):
        if not Path(prefix + suffix).is_file():
            raise DataError(
                f"{prefix}{suffix}: dataset file not found; fix: run "
                f"'pretrain prepare-data --output {prefix} ...' or correct data.prefix / data.blend"
            )
    checked_token_ids(prefix, vocab_size())
    for directory in cache_dirs(data.cache_dir, prefix):
        check_index_cache(directory)  # Megatron loads these with allow_pickle=True
    if torch.distributed.is_initialized():
        # Every rank checked before rank 0 writes a missing index in the builder below: a rank that
        # checked while rank 0 was writing one (np.save is not atomic) read a truncated file and
        # failed the job's first start on a fresh cache (seen in CI). Megatron barriers the same way.
        torch.distributed.barrier()
    ds_config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([prefix], None),
        split=data.split.replace("/", ","),
        tokenizer=load_tokenizer(data.tokenizer, data.tokenizer_path),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=data.cache_dir,
    )
    train, valid, _test = BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, ds_config).build()
    if train is None or len(train) == 0:
        raise DataError(f"{prefix}.bin: no training samples of length {seq_length}; fix: add data")
    if data.split_weights()[1] > 0 and (valid is None or len(valid) == 0):
        raise DataError(
            f"{prefix}.bin: the valid split ({data.split}) holds no sample of length {seq_length}; "
            "fix: give it a larger weight in data.split or add data"
        )
    return train, valid


def build_datasets(
    data: DataConfig, seed: int, seq_length: int, vocab_size: Callable[[], int]
) -> tuple[Dataset, Dataset | None]:
    """The train split and, when ``data.split`` gives it a weight, the valid split: of ``data.prefix``,
    or of every dataset of ``data.blend`` blended by weight (:class:`BlendedSamples`). ``seed``:
    ``train.seed``; ``seq_length``: ``model.seq_length``; ``vocab_size``: the run's vocabulary
    (:func:`pretrain.config.resolve_vocab_size`), asked for once a dataset's files are found."""
    parts = data.prefixes()
    splits = [_split_of(data, seed, seq_length, vocab_size, prefix) for prefix, _ in parts]
    if len(splits) == 1:
        return splits[0]
    weights = [w for _, w in parts]
    train = BlendedSamples([t for t, _ in splits], weights)
    valids = [v for _, v in splits]
    valid = BlendedSamples(valids, weights) if all(v is not None for v in valids) else None
    return train, valid


def snapshot_id(data: DataConfig) -> str:
    """Identity of the training data: the index digest of ``data.prefix``, or of every blended
    dataset with its weight."""
    parts = data.prefixes()
    if len(parts) == 1:
        return dataset_snapshot_id(parts[0][0])
    joined = ";".join(f"{dataset_snapshot_id(p)}*{w}" for p, w in parts)
    return "blend:sha256:" + hashlib.sha256(joined.encode()).hexdigest()


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

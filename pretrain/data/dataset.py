"""Megatron ``GPTDataset``s over prepared indexed datasets (one prefix or a weighted blend), their
train/valid splits and the dataset snapshot id (the order they are read in:
:mod:`pretrain.data.sampler`)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

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

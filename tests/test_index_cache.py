"""Megatron's dataset index cache is checked before Megatron opens it (it loads with
allow_pickle=True): a pickle named like an index file, and an object array, are refused in one
line naming the file; nothing in them runs; real index arrays pass."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from pretrain.data.index_cache import check_index_cache
from pretrain.errors import DataError


class _Gadget:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_or_an_object_array_in_the_cache_is_refused_and_never_runs(tmp_path: Path) -> None:
    cache = tmp_path / "cache" / "GPTDataset_indices"
    cache.mkdir(parents=True)
    np.save(cache / "abc-GPTDataset-train-document_index.npy", np.arange(100, dtype=np.int32))
    np.save(cache / "abc-GPTDataset-train-sample_index.npy", np.zeros((10, 2), dtype=np.int64))
    check_index_cache(tmp_path / "cache")  # real index arrays pass
    marker = tmp_path / "gadget-ran"
    planted = cache / "abc-GPTDataset-train-shuffle_index.npy"
    planted.write_bytes(pickle.dumps(_Gadget(marker)))
    with pytest.raises(DataError) as err:
        check_index_cache(tmp_path / "cache")
    assert str(planted) in str(err.value) and "not a numpy array file" in str(err.value) and "\n" not in str(err.value)
    planted.unlink()
    np.save(planted, np.array([_Gadget(marker)], dtype=object), allow_pickle=True)
    with pytest.raises(DataError, match="holding Python objects"):
        check_index_cache(tmp_path / "cache")
    assert not marker.exists(), "nothing in the planted files ran"

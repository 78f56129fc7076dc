"""Data blends: samples drawn per dataset follow the weights, the blend does not depend on the run
length, bad blends are refused in one line, data with ids beyond the vocabulary is refused. (A
blended run with a trained tokenizer and evaluation resumes bit-exactly: tests/test_validation.py.)"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from torch.utils.data import Dataset

from pretrain.config import Config, load_config, resolve_vocab_size, validate
from pretrain.data.blend import BlendedSamples
from pretrain.data.dataset import build_datasets
from pretrain.data.prepare import build_indexed_dataset, synthetic_documents
from pretrain.data.sampler import GlobalBatchSampler
from pretrain.errors import ConfigError, DataError
from tests.helpers import TINY, blend_override


@pytest.fixture(scope="module")
def two_corpora(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("blend")
    build_indexed_dataset(synthetic_documents(0.4, seed=11), d / "web")
    build_indexed_dataset(synthetic_documents(0.2, seed=12), d / "code")
    return d / "web", d / "code"


def _datasets(cfg: Config) -> tuple[Dataset, Dataset | None]:
    return build_datasets(cfg.data, cfg.train.seed, cfg.model.seq_length, lambda: resolve_vocab_size(cfg))


def test_samples_per_dataset_follow_the_weights(two_corpora: tuple[Path, Path]) -> None:
    a, b = two_corpora
    cfg = load_config(TINY, [f"data.blend={blend_override(a, b, 0.7, 0.3)}", "data.split=95,5,0"])
    train, valid = _datasets(cfg)
    assert isinstance(train, BlendedSamples) and isinstance(valid, BlendedSamples)
    sampler = GlobalBatchSampler(len(train), 8, 2, 0, 1, seed=1234)
    drawn = Counter(int(train.part_index[sampler.dataset_index(p)]) for p in range(10_000))
    assert abs(drawn[0] / 10_000 - 0.7) < 0.02 and abs(drawn[1] / 10_000 - 0.3) < 0.02, drawn
    # The blend is a function of the datasets and weights only (not of train.steps): same bytes twice.
    again, _ = _datasets(load_config(TINY, [f"data.blend={blend_override(a, b, 0.7, 0.3)}", "data.split=95,5,0"]))
    assert (again.part_index == train.part_index).all() and (again.part_sample == train.part_sample).all()
    sample = train[0]
    assert set(sample) >= {"tokens", "labels", "loss_mask", "position_ids", "dataset_id"}


@pytest.mark.parametrize(
    ("blend", "message"),
    [
        ("[{prefix: A, weight: -1}, {prefix: B, weight: 1}]", "data.blend[0]: needs a prefix and a weight >= 0; fix:"),
        ("[{prefix: A, weight: 0}, {prefix: B, weight: 0}]", "data.blend: every weight is zero; fix:"),
        ("[{weight: 1}]", "data.blend[0]: needs a prefix and a weight >= 0; fix:"),
        ("{prefix: A}", "data.blend must be a list; fix:"),
    ],
)
def test_bad_blends_are_refused_in_one_line(blend: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        validate(load_config(TINY, [f"data.blend={blend}"]), 2, False)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_missing_blend_prefix_names_the_file(two_corpora: tuple[Path, Path], tmp_path: Path) -> None:
    a, _ = two_corpora
    cfg = load_config(TINY, [f"data.blend={blend_override(a, tmp_path / 'gone', 0.5, 0.5)}"])
    with pytest.raises(DataError) as caught:
        _datasets(cfg)
    assert f"{tmp_path / 'gone'}.bin: dataset file not found" in str(caught.value) and "fix:" in str(caught.value)


def test_a_dataset_with_ids_beyond_the_vocabulary_is_refused(hf_corpora: dict[str, Path]) -> None:
    """Data made with a 400-token BPE vocabulary, trained on with the byte tokenizer (257)."""
    cfg = load_config(TINY, [f"data.prefix={hf_corpora['web']}"])
    with pytest.raises(DataError) as caught:
        _datasets(cfg)
    message = str(caught.value)
    assert f"{hf_corpora['web']}.bin: token id" in message and ">= vocabulary size 257" in message and "fix:" in message

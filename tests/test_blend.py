"""Data blends: samples drawn per dataset follow the weights, the blend does not depend on the run
length, bad blends are refused in one line, and a blended run with evaluation resumes bit-exactly
after a SIGKILL."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from pretrain.config import load_config, validate
from pretrain.data.blend import BlendedSamples
from pretrain.data.dataset import GlobalBatchSampler, build_datasets
from pretrain.data.prepare import build_indexed_dataset, synthetic_documents
from pretrain.errors import ConfigError, DataError
from tests.helpers import TINY, events, ft_launch, metrics_by_step, overrides_for, torchrun


@pytest.fixture(scope="module")
def two_corpora(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("blend")
    build_indexed_dataset(synthetic_documents(0.4, seed=11), d / "web")
    build_indexed_dataset(synthetic_documents(0.2, seed=12), d / "code")
    return d / "web", d / "code"


def _blend(a: Path, b: Path, wa: float, wb: float) -> str:
    return f"[{{prefix: {a}, weight: {wa}}}, {{prefix: {b}, weight: {wb}}}]"


def test_samples_per_dataset_follow_the_weights(two_corpora: tuple[Path, Path]) -> None:
    a, b = two_corpora
    cfg = load_config(TINY, [f"data.blend={_blend(a, b, 0.7, 0.3)}", "data.split=95,5,0"])
    train, valid = build_datasets(cfg)
    assert isinstance(train, BlendedSamples) and isinstance(valid, BlendedSamples)
    sampler = GlobalBatchSampler(len(train), 8, 2, 0, 1, seed=1234)
    drawn = Counter(int(train.part_index[sampler.dataset_index(p)]) for p in range(10_000))
    assert abs(drawn[0] / 10_000 - 0.7) < 0.02 and abs(drawn[1] / 10_000 - 0.3) < 0.02, drawn
    # The blend is a function of the datasets and weights only (not of train.steps): same bytes twice.
    again, _ = build_datasets(load_config(TINY, [f"data.blend={_blend(a, b, 0.7, 0.3)}", "data.split=95,5,0"]))
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
    cfg = load_config(TINY, [f"data.blend={_blend(a, tmp_path / 'gone', 0.5, 0.5)}"])
    with pytest.raises(DataError) as caught:
        build_datasets(cfg)
    assert f"{tmp_path / 'gone'}.bin: dataset file not found" in str(caught.value) and "fix:" in str(caught.value)


@pytest.mark.slow
def test_a_blended_run_with_evaluation_resumes_bit_exact(two_corpora: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = two_corpora
    common = {
        "train.steps": 40,
        "checkpoint.local.interval": 10,
        "checkpoint.reshardable.interval": 20,
        "data.blend": _blend(a, b, 0.6, 0.4),
        "data.split": "90,10,0",
        "eval.interval": 10,
    }
    base = tmp_path / "base"
    torchrun(base, 2, overrides_for(base, a, **common))
    crash = tmp_path / "crash"
    kill = {"fault_tolerance.inject.kill_rank": 1, "fault_tolerance.inject.kill_at_step": 27}
    ft_launch(crash, 2, overrides_for(crash, a, **common, **kill))
    assert [e["step"] for e in events(crash / "runs" / "t") if e["event"] == "restore"] == [20]
    got, want = metrics_by_step(crash / "runs" / "t"), metrics_by_step(base / "runs" / "t")
    assert sorted(got) == sorted(want) == list(range(1, 41))
    for step in range(21, 41):
        assert got[step]["loss"] == want[step]["loss"] and got[step]["grad_norm"] == want[step]["grad_norm"], step

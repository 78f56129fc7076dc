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
from pretrain.data.train_tokenizer import train_bpe_tokenizer
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


@pytest.fixture(scope="module")
def hf_corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two BPE tokenizers of one size trained on different text, and two datasets made with the first."""
    d = tmp_path_factory.mktemp("hf")
    text_a, text_b = d / "a.txt", d / "b.txt"
    text_a.write_text("\n\n".join(synthetic_documents(0.3, seed=21)))
    text_b.write_text("\n\n".join(synthetic_documents(0.3, seed=22)).upper())
    train_bpe_tokenizer([text_a], 400, d / "tok-a.json")
    train_bpe_tokenizer([text_b], 400, d / "tok-b.json")
    for name, seed, mb in (("web", 31, 0.3), ("code", 32, 0.2)):
        hf = {"tokenizer": "huggingface", "tokenizer_path": str(d / "tok-a.json")}
        build_indexed_dataset(synthetic_documents(mb, seed=seed), d / name, **hf)
    return {"web": d / "web", "code": d / "code", "tok_a": d / "tok-a.json", "tok_b": d / "tok-b.json"}


@pytest.mark.slow
def test_hf_tokenizer_blend_and_evaluation_resume_bit_exact(hf_corpora: dict[str, Path], tmp_path: Path) -> None:
    """The heartbeat test on a real workload shape: a trained BPE tokenizer, a two-prefix blend and
    evaluation on; then a resume with another tokenizer (same vocabulary size) is refused in one line."""
    a, b = hf_corpora["web"], hf_corpora["code"]
    common = {
        "train.steps": 40,
        "checkpoint.local.interval": 10,
        "checkpoint.reshardable.interval": 20,
        "data.tokenizer": "huggingface",
        "data.tokenizer_path": str(hf_corpora["tok_a"]),
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

    other = {**common, "train.steps": 50, "data.tokenizer_path": str(hf_corpora["tok_b"])}
    proc = torchrun(base, 2, overrides_for(base, a, **other), check=False)
    assert proc.returncode != 0
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if "IncompatibleCheckpoint:" in x and "failed" in x]
    assert lines and "trained with tokenizer huggingface" in lines[0] and "fix:" in lines[0], proc.stderr[-2000:]
    assert "tok-a.json" in lines[0] and "tok-b.json" in lines[0]


def test_a_dataset_with_ids_beyond_the_vocabulary_is_refused(hf_corpora: dict[str, Path]) -> None:
    """Data made with a 400-token BPE vocabulary, trained on with the byte tokenizer (257)."""
    cfg = load_config(TINY, [f"data.prefix={hf_corpora['web']}"])
    with pytest.raises(DataError) as caught:
        build_datasets(cfg)
    message = str(caught.value)
    assert f"{hf_corpora['web']}.bin: token id" in message and ">= vocabulary size 257" in message and "fix:" in message

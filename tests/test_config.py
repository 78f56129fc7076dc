"""Config: YAML -> typed dataclasses; every bad input fails with one line naming key, file and fix."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from pretrain.config import load_config, padded_vocab_size, validate
from pretrain.data.train_tokenizer import train_bpe_tokenizer
from pretrain.errors import ConfigError
from tests.helpers import PYTHON, REPO, TINY

REQUIRED_KEYS = [
    "run.id",
    "run.dir",
    "train.steps",
    "train.seed",
    "train.log_interval",
    "parallel.tp",
    "parallel.pp",
    "checkpoint.local.dir",
    "checkpoint.local.interval",
    "checkpoint.local.keep",
]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_shipped_configs_load_and_validate(tmp_path: Path) -> None:
    tiny = load_config(TINY)
    for world in (1, 2, 4):
        validate(tiny, world, cuda=False)
    assert (
        64 <= tiny.model.hidden_size <= 256 and 2 <= tiny.model.num_layers <= 4 and 64 <= tiny.model.seq_length <= 128
    )
    # The Llama-3 tokenizer.json it names lives on the cluster: a small local one stands in here.
    tok = tmp_path / "tokenizer.json"
    train_bpe_tokenizer([REPO / "README.md"], 300, tok)
    big = load_config(REPO / "configs" / "gpt-8b-h100.yaml", [f"data.tokenizer_path={tok}"])
    validate(big, 64, cuda=True)
    assert big.data.tokenizer == "huggingface" and len(big.data.blend) == 2 and big.eval.interval > 0
    assert big.model.spec == "te" and big.model.precision == "bf16" and big.parallel.distributed_optimizer == "on"
    assert big.parallel.tp * big.parallel.pp > 1
    with pytest.raises(ConfigError, match="model.spec"):
        validate(big, 64, cuda=False)


def test_required_keys_exist_and_override() -> None:
    cfg = load_config(
        TINY, [f"{key}={value}" for key, value in zip(REQUIRED_KEYS, ["r1", "/tmp/x", 200, 7, 5, 1, 1, "/nvme", 25, 4])]
    )
    assert (cfg.run.id, cfg.run.dir, cfg.train.steps, cfg.train.seed, cfg.train.log_interval) == (
        "r1",
        "/tmp/x",
        200,
        7,
        5,
    )
    assert (cfg.checkpoint.local.dir, cfg.checkpoint.local.interval, cfg.checkpoint.local.keep) == ("/nvme", 25, 4)


@pytest.mark.parametrize(
    ("text", "overrides", "needle"),
    [
        ("train:\n  stepz: 10\n", [], "unknown key 'train.stepz'; fix: remove it (did you mean 'train.steps'?)"),
        ("bogus:\n  a: 1\n", [], "unknown key 'bogus'"),
        ("train:\n  steps: ten\n", [], "train.steps='ten' has type str, expected int"),
        ("train:\n  steps: 1.5\n", [], "train.steps=1.5 has type float, expected int"),
        ("model:\n  precision: fp8\n", [], "model.precision='fp8' is not allowed"),
        ("checkpoint:\n  local: 3\n", [], "checkpoint.local: expected a mapping"),
        ("train: [1, 2\n", [], "not valid YAML"),
        ("- a\n- b\n", [], "top level must be a mapping"),
        ("", ["train.steps"], "expected KEY=VALUE"),
        ("", ["train.steps=abc"], "train.steps='abc'"),
        ("", ["fault_tolerance.hang_watch_s=soon"], "hang_watch_s='soon' is not allowed; fix: give a float or auto"),
    ],
)
def test_bad_config_names_key_file_and_fix(tmp_path: Path, text: str, overrides: list[str], needle: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    msg = str(err.value)
    assert needle in msg and "\n" not in msg and "fix" in msg
    if not overrides:
        assert str(path) in msg


@pytest.mark.parametrize(
    ("overrides", "world", "key"),
    [
        (["parallel.tp=3"], 3, "parallel.tp"),  # 3 does not divide 4 heads
        (["parallel.tp=2"], 3, "parallel.tp"),  # world 3 not divisible by tp*pp=2
        (["parallel.pp=3"], 3, "parallel.pp"),  # 2 layers
        (["data.global_batch_size=6"], 4, "data.global_batch_size"),
        (["train.steps=0"], 1, "train.steps"),
        (["checkpoint.local.keep=0"], 1, "checkpoint.local.keep"),
        (["model.hidden_dropout=1.5"], 1, "model.hidden_dropout"),
        (["optimizer.min_lr=1.0"], 1, "optimizer.min_lr"),
        (["model.precision=bf16"], 1, "model.precision"),
        (["parallel.sequence_parallel=true", "parallel.tp=2"], 2, "parallel.sequence_parallel"),
        (["parallel.distributed_optimizer=on"], 1, "parallel.distributed_optimizer"),
        (["run.id=a/b"], 1, "run.id"),
        (["parallel.pp=2"], 2, "model.untie_embeddings"),
        (["fault_tolerance.inject.kill_rank=5"], 2, "fault_tolerance.inject.kill_rank"),
        (["checkpoint.integrity.chunk_mb=2048"], 1, "checkpoint.integrity.chunk_mb"),
        (["checkpoint.local.stall_timeout_s=0"], 1, "checkpoint.local.stall_timeout_s"),
        (["checkpoint.reshardable.stall_timeout_s=-1"], 1, "checkpoint.reshardable.stall_timeout_s"),
        (["checkpoint.reshardable.probe_interval_s=0"], 1, "checkpoint.reshardable.probe_interval_s"),
        (["fault_tolerance.hang_watch_s=1.5"], 1, "fault_tolerance.hang_watch_s"),  # 0, auto or >= 2 s
        (["fault_tolerance.node_lost_s=0.5"], 1, "fault_tolerance.node_lost_s"),  # 0 or >= 1 s
    ],
)
def test_impossible_combinations_fail_validation(overrides: list[str], world: int, key: str) -> None:
    cfg = load_config(TINY, overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg, world, cuda=False)
    assert key in str(err.value) and str(TINY) in str(err.value) and "fix:" in str(err.value)


def test_padded_vocab_does_not_depend_on_tp() -> None:
    assert padded_vocab_size(load_config(TINY, ["parallel.tp=1"])) == padded_vocab_size(
        load_config(TINY, ["parallel.tp=2"])
    )


def test_cli_rejects_bad_config_before_any_process_group(tmp_path: Path) -> None:
    path = _write(tmp_path, "parallel:\n  tp: 3\n")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [PYTHON, "-m", "pretrain", "train", "--config", str(path)],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "WORLD_SIZE": "2", "RANK": "0", "PYTHONWARNINGS": "ignore"},
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "parallel.tp" in lines[0] and str(path) in lines[0], proc.stderr
    assert time.perf_counter() - t0 < 60

"""Tokenizers read offline (byte, Hugging Face tokenizer.json, SentencePiece), BPE training, and
prepare-data over text and JSONL files into Megatron's indexed dataset: real files, no mocks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import sentencepiece
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tokenizers import Tokenizer, models

from pretrain.checkpointing.state import check_compatible
from pretrain.cli import main
from pretrain.config import load_config, padded_vocab_size, resolve_vocab_size, validate
from pretrain.data.dataset import build_train_dataset
from pretrain.data.prepare import (
    build_indexed_dataset,
    check_token_ids,
    prepare_data,
    synthetic_documents,
    token_dtype,
)
from pretrain.data.tokenizer import ByteTokenizer, load_tokenizer, tokenizer_identity
from pretrain.data.train_tokenizer import train_bpe_tokenizer
from pretrain.errors import ConfigError, DataError, IncompatibleCheckpoint
from tests.helpers import TINY

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "Checkpoints are verified before they are published; a restore reads the newest verified step.",
    "Ünïcödé text survives: naïve café, 東京, emoji 🚀 and tabs\tinside.",
    "Short one.",
    "A second paragraph line\nthat continues on the next line.",
]


def _write_text(path: Path, docs: list[str]) -> Path:
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


def _write_jsonl(path: Path, docs: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path


def _corpus(tmp: Path) -> Path:
    return _write_text(tmp / "corpus.txt", [*DOCS, *synthetic_documents(0.05, seed=3)])


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer.json trained offline on a small corpus."""
    tmp = tmp_path_factory.mktemp("bpe")
    out = tmp / "tok" / "tokenizer.json"
    train_bpe_tokenizer([_corpus(tmp)], 600, out)
    return out


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SentencePiece model trained offline in the test."""
    tmp = tmp_path_factory.mktemp("spm")
    text = tmp / "spm.txt"
    text.write_text("\n".join([*DOCS[:2], *synthetic_documents(0.03, seed=5)]) + "\n", encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(tmp / "sp"),
        vocab_size=120,
        character_coverage=1.0,
        minloglevel=2,
        num_threads=1,
    )
    return tmp / "sp.model"


def _one_line_naming(exc: BaseException, path: Path | str) -> None:
    text = str(exc)
    assert "\n" not in text and str(path) in text and "fix:" in text, text


# --- tokenizers -------------------------------------------------------------------------------


def test_bpe_training_is_deterministic_and_offline(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path)
    jsonl = _write_jsonl(tmp_path / "more.jsonl", DOCS)
    first = train_bpe_tokenizer([corpus, jsonl], 500, tmp_path / "a.json", special_tokens=["<pad>"])
    second = train_bpe_tokenizer([corpus, jsonl], 500, tmp_path / "b.json", special_tokens=["<pad>"])
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert first == {**second, "file": "a.json"}
    tok = load_tokenizer("huggingface", tmp_path / "a.json")
    vocab = tok.vocab
    assert vocab["<|endoftext|>"] == 0 and vocab["<pad>"] == 1 and tok.eod == 0  # end-of-text first
    assert tok.vocab_size == first["vocab_size"] <= 500


def test_train_tokenizer_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = _write_jsonl(tmp_path / "c.jsonl", [*DOCS, *synthetic_documents(0.02)], key="body")
    out = tmp_path / "t.json"
    argv = ["train-tokenizer", "--input", str(corpus), "--vocab-size", "400", "--output", str(out)]
    assert main([*argv, "--json-key", "body", "--special-tokens", "</s>", "<pad>"]) == 0
    assert "vocab" in capsys.readouterr().out
    assert load_tokenizer("huggingface", out).eod == 0  # </s> is an end-of-text token: no <|endoftext|> added
    assert main([*argv[:-2], "--output", str(tmp_path / "u.json"), "--vocab-size", "100"]) == 2  # < 256 + 1
    assert "fix:" in capsys.readouterr().err


def test_huggingface_tokenizer_round_trips(bpe: Path) -> None:
    for path in (bpe, bpe.parent):  # the file, or a directory holding tokenizer.json
        tok = load_tokenizer("huggingface", path)
        for text in DOCS:
            ids = tok.tokenize(text)
            assert ids and max(ids) < tok.vocab_size and tok.eod not in ids
            assert tok.detokenize(ids) == text
            assert tok.detokenize([*ids, tok.eod]) == text
    ident = tokenizer_identity("huggingface", bpe)
    assert ident["kind"] == "huggingface" and ident["eod"] == tok.eod and ident["vocab_size"] == tok.vocab_size
    assert len(ident["sha256"]) == 64 and tok.unique_identifiers["sha256"] == ident["sha256"]


def test_sentencepiece_tokenizer_round_trips(spm_model: Path) -> None:
    tok = load_tokenizer("sentencepiece", spm_model)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_model))
    assert tok.vocab_size == 120 and tok.eod == sp.eos_id() == 2
    for text in DOCS[:2]:
        ids = tok.tokenize(text)
        assert ids == sp.encode(text) and tok.detokenize(ids) == text
    assert tokenizer_identity("sentencepiece", spm_model)["eod"] == 2


def test_byte_tokenizer_is_unchanged() -> None:
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 257 and tok.eod == 256
    assert tok.unique_identifiers == {"class": "ByteTokenizer", "vocab_size": 257, "eod": 256}
    assert tok.tokenize("hé") == [104, 195, 169] and tok.detokenize([104, 195, 169, 256]) == "hé"
    assert tokenizer_identity("byte") == {"kind": "byte", "file": None, "sha256": None, "vocab_size": 257, "eod": 256}


def test_tokenizer_without_end_of_document_is_refused(tmp_path: Path) -> None:
    words = tmp_path / "words.json"
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(words))
    with pytest.raises(ConfigError) as caught:
        load_tokenizer("huggingface", words)
    _one_line_naming(caught.value, words)
    text = tmp_path / "t.txt"
    text.write_text("\n".join(DOCS * 20))
    sentencepiece.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(tmp_path / "noeos"), vocab_size=60, eos_id=-1, minloglevel=2, num_threads=1
    )
    with pytest.raises(ConfigError) as caught:
        load_tokenizer("sentencepiece", tmp_path / "noeos.model")
    _one_line_naming(caught.value, tmp_path / "noeos.model")


def test_wrong_kind_missing_or_unreadable_files_are_refused(tmp_path: Path, bpe: Path, spm_model: Path) -> None:
    random_file = tmp_path / "random.bin"
    random_file.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    empty = tmp_path / "empty.model"
    empty.write_bytes(b"")
    cases = [
        ("huggingface", spm_model, spm_model),  # a .model given as huggingface
        ("sentencepiece", bpe, bpe),  # a tokenizer.json given as sentencepiece
        ("huggingface", random_file, random_file),
        ("sentencepiece", random_file, random_file),
        ("sentencepiece", empty, empty),
        ("huggingface", tmp_path / "nope.json", tmp_path / "nope.json"),
        ("huggingface", tmp_path, tmp_path),  # a directory without tokenizer.json
        ("sentencepiece", None, "<no path>"),
        ("byte", bpe, bpe),  # the byte tokenizer reads no file
    ]
    if os.geteuid() != 0:  # root reads any file
        locked = tmp_path / "locked.json"
        locked.write_bytes(bpe.read_bytes())
        locked.chmod(0)
        cases.append(("huggingface", locked, locked))
    for kind, path, named in cases:
        with pytest.raises(ConfigError) as caught:
            load_tokenizer(kind, path)
        _one_line_naming(caught.value, named)


# --- vocabulary size ------------------------------------------------------------------------------


def test_vocab_size_is_derived_from_the_tokenizer(bpe: Path, spm_model: Path) -> None:
    byte = load_config(TINY)
    assert byte.model.vocab_size is None and resolve_vocab_size(byte) == 257 and padded_vocab_size(byte) == 384
    assert padded_vocab_size(load_config(TINY, ["model.vocab_size=257"])) == 384
    hf = load_config(TINY, ["data.tokenizer=huggingface", f"data.tokenizer_path={bpe}"])
    size = load_tokenizer("huggingface", bpe).vocab_size
    assert resolve_vocab_size(hf) == size and padded_vocab_size(hf) == -(-size // 128) * 128
    validate(hf, 1, False)
    sp = load_config(TINY, ["data.tokenizer=sentencepiece", f"data.tokenizer_path={spm_model}"])
    assert resolve_vocab_size(sp) == 120 and padded_vocab_size(sp) == 128
    bigger = load_config(TINY, ["data.tokenizer=huggingface", f"data.tokenizer_path={bpe}", "model.vocab_size=1000"])
    assert resolve_vocab_size(bigger) == 1000 and padded_vocab_size(bigger) == 1024


def test_a_vocab_size_smaller_than_the_tokenizer_is_refused(bpe: Path) -> None:
    for overrides in (
        ["model.vocab_size=256"],
        ["data.tokenizer=huggingface", f"data.tokenizer_path={bpe}", "model.vocab_size=300"],
    ):
        with pytest.raises(ConfigError) as caught:
            validate(load_config(TINY, overrides), 1, False)
        assert "model.vocab_size" in str(caught.value)
        _one_line_naming(caught.value, TINY)


def test_config_names_the_bad_tokenizer_file(tmp_path: Path, spm_model: Path) -> None:
    for overrides, named in (
        (["data.tokenizer=huggingface", f"data.tokenizer_path={spm_model}"], spm_model),
        (["data.tokenizer=sentencepiece", f"data.tokenizer_path={tmp_path / 'x.model'}"], tmp_path / "x.model"),
        (["data.tokenizer=huggingface"], "data.tokenizer_path"),
        ([f"data.tokenizer_path={spm_model}"], "data.tokenizer_path"),
    ):
        with pytest.raises(ConfigError) as caught:
            validate(load_config(TINY, overrides), 1, False)
        _one_line_naming(caught.value, named)


def test_checkpoints_compare_the_resolved_vocabulary(tmp_path: Path, bpe: Path) -> None:
    """A checkpoint saved with the explicit 257 of the old tiny config loads with the derived one."""
    saved = {"config": load_config(TINY, ["model.vocab_size=257"]).to_dict()}
    check_compatible(load_config(TINY), saved, tmp_path)
    with pytest.raises(IncompatibleCheckpoint, match="vocab_size"):
        check_compatible(
            load_config(TINY, ["data.tokenizer=huggingface", f"data.tokenizer_path={bpe}"]), saved, tmp_path
        )


# --- prepare-data ---------------------------------------------------------------------------------


def test_token_dtype_follows_megatron() -> None:
    assert token_dtype(257) is np.uint16 and token_dtype(65499) is np.uint16
    assert token_dtype(65500) is np.int32 and token_dtype(128256) is np.int32


def test_byte_dataset_bytes_are_unchanged(tmp_path: Path) -> None:
    counts = build_indexed_dataset(iter(DOCS), tmp_path / "d")
    expected = np.concatenate([np.array([*d.encode("utf-8"), 256], dtype=np.uint16) for d in DOCS])
    assert (tmp_path / "d.bin").read_bytes() == expected.tobytes()
    assert counts["documents"] == len(DOCS) and counts["tokens"] == expected.size
    assert not list(tmp_path.glob("*.tmp-*"))


def test_jsonl_dataset_equals_the_text_dataset(tmp_path: Path, bpe: Path) -> None:
    text = _write_text(tmp_path / "docs.txt", DOCS)
    jsonl = _write_jsonl(tmp_path / "docs.jsonl", DOCS)
    a = prepare_data(tmp_path / "a", [text], tokenizer="huggingface", tokenizer_path=bpe, progress=False)
    b = prepare_data(tmp_path / "b", [jsonl], tokenizer="huggingface", tokenizer_path=bpe, progress=False)
    counts = ("documents", "tokens", "dropped", "bad_files")
    assert [a[k] for k in counts] == [b[k] for k in counts] and a["documents"] == len(DOCS)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"a{suffix}").read_bytes() == (tmp_path / f"b{suffix}").read_bytes()
    assert len(IndexedDataset(str(tmp_path / "a")).document_indices) - 1 == len(DOCS)


def test_workers_give_identical_bytes(tmp_path: Path, bpe: Path) -> None:
    docs = list(synthetic_documents(0.25, seed=11))
    assert len(docs) > 256  # more than one batch
    for workers in (1, 2):
        build_indexed_dataset(iter(docs), tmp_path / f"w{workers}", "huggingface", bpe, workers=workers)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"w1{suffix}").read_bytes() == (tmp_path / f"w2{suffix}").read_bytes()


def test_bad_jsonl_lines_name_file_and_line_or_are_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "good one"}\nnot json at all\n\n{"body": "no text key"}\n{"text": "good two"}\n')
    with pytest.raises(DataError) as caught:
        prepare_data(tmp_path / "out", [path], progress=False)
    _one_line_naming(caught.value, f"{path}:2")
    assert not (tmp_path / "out.bin").exists() and not list(tmp_path.glob("*.tmp-*"))
    counts = prepare_data(tmp_path / "out", [path], skip_bad_lines=True, progress=False)
    assert counts["documents"] == 2 and counts["skipped_lines"] == 2
    assert main(["prepare-data", "--input", str(path), "--output", str(tmp_path / "c")]) == 2
    assert f"{path}:2:" in capsys.readouterr().err
    argv = ["prepare-data", "--input", str(path), "--output", str(tmp_path / "c"), "--skip-bad-lines", "--workers", "1"]
    assert main(argv) == 0
    assert "2 documents" in capsys.readouterr().out


def test_empty_input_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n   \n\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError) as caught:
        prepare_data(tmp_path / "out", [blank, empty], progress=False)
    _one_line_naming(caught.value, blank)
    assert not list(tmp_path.glob("out*"))
    assert main(["prepare-data", "--input", str(blank), "--output", str(tmp_path / "out")]) == 2
    assert "no documents" in capsys.readouterr().err


def test_check_token_ids_refuses_ids_outside_the_vocabulary(tmp_path: Path) -> None:
    build_indexed_dataset(iter(DOCS), tmp_path / "d")
    assert check_token_ids(tmp_path / "d", 257) == 256
    with pytest.raises(DataError) as caught:
        check_token_ids(tmp_path / "d", 200)
    _one_line_naming(caught.value, tmp_path / "d.bin")
    with pytest.raises(DataError):
        check_token_ids(tmp_path / "missing", 257)


def test_megatron_reads_the_dataset_and_writes_the_same_bytes(tmp_path: Path, spm_model: Path) -> None:
    """Megatron-LM's preprocess_data.py writes with the same builder: same bytes, read back as is."""
    counts = build_indexed_dataset(iter(DOCS), tmp_path / "ours", "sentencepiece", spm_model)
    tok = load_tokenizer("sentencepiece", spm_model)
    builder = IndexedDatasetBuilder(str(tmp_path / "megatron.bin"), dtype=np.uint16)
    for doc in DOCS:
        ids = [*tok.tokenize(doc), tok.eod]
        builder.add_document(ids, [len(ids)])
    builder.finalize(str(tmp_path / "megatron.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"megatron{suffix}").read_bytes()
    ds = IndexedDataset(str(tmp_path / "ours"))
    assert len(ds.document_indices) - 1 == counts["documents"] == len(DOCS) and ds.index.dtype == np.uint16
    assert ds[0].tolist() == [*tok.tokenize(DOCS[0]), tok.eod]
    assert check_token_ids(tmp_path / "megatron", tok.vocab_size) < tok.vocab_size


def test_training_dataset_uses_the_configured_tokenizer(tmp_path: Path, bpe: Path) -> None:
    docs = list(synthetic_documents(0.1, seed=2))
    build_indexed_dataset(iter(docs), tmp_path / "hf", "huggingface", bpe)
    cfg = load_config(
        TINY,
        [
            f"data.prefix={tmp_path / 'hf'}",
            "data.tokenizer=huggingface",
            f"data.tokenizer_path={bpe}",
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
    )
    dataset = build_train_dataset(cfg.data, cfg.train.seed, cfg.model.seq_length, lambda: resolve_vocab_size(cfg))
    sample = dataset[0]["tokens"]
    assert len(dataset) > 0 and int(sample.max()) < resolve_vocab_size(cfg)

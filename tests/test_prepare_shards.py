"""Sharded preparation: shards merged with megatron-core's add_index equal the one-machine dataset
token for token (duplicates across shard boundaries included), a finished shard is not redone, a
changed shard count and a tokenizer mix are refused in one line; the gates and their report."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from pretrain.cli import main
from pretrain.data.gates import COMMIT_EVERY, DigestSet, DocumentGates, text_digest
from pretrain.data.inputs import shard_files
from pretrain.data.prepare import merge_data, prepare_data
from pretrain.data.train_tokenizer import train_bpe_tokenizer
from tests.prepare_corpus import write_corpus

COUNTED = ("documents", "tokens", "dropped", "bad_files", "settings")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus") / "corpus"
    write_corpus(root)
    return root


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe_tokenizer([corpus / "a.jsonl"], 400, out)
    return out


def _same_dataset(a: Path, b: Path) -> None:
    for suffix in (".bin", ".idx"):
        assert Path(f"{a}{suffix}").read_bytes() == Path(f"{b}{suffix}").read_bytes(), suffix


def test_shards_split_the_file_list_into_contiguous_runs_that_cover_it(tmp_path: Path) -> None:
    files = []
    for i, size in enumerate([5, 1, 1, 40, 3, 3, 3, 9, 1, 2]):
        (tmp_path / f"{i:02d}").write_bytes(b"x" * size * 100)
        files.append(tmp_path / f"{i:02d}")
    for count in (1, 2, 3, 4, 7, 10, 16):
        parts = [shard_files(files, i, count) for i in range(count)]
        assert [p for part in parts for p in part] == files, count
    # the 40-unit file is alone in the middle of a 4-way split: cuts follow sizes, not file counts
    assert [len(shard_files(files, i, 4)) for i in range(4)] == [3, 1, 1, 5]


@pytest.mark.parametrize("count", [3, 4])
def test_shards_merged_equal_the_one_machine_dataset_with_gates(tmp_path: Path, corpus: Path, count: int) -> None:
    opts = {"min_chars": 20, "dedup": True, "progress": False}
    one = prepare_data(tmp_path / "one", [corpus], **opts)
    assert one["dropped"]["duplicate"] > 0 and one["dropped"]["too_short"] > 0
    reports = [prepare_data(tmp_path / "sh", [corpus], shard=(i, count), **opts) for i in range(count)]
    assert sum(r["files"] for r in reports) == 6
    # documents repeat across files, so some duplicates are only seen by the merge
    assert sum(r["dropped"]["duplicate"] for r in reports) < one["dropped"]["duplicate"]
    merged = merge_data(tmp_path / "sh", tmp_path / "merged")
    _same_dataset(tmp_path / "one", tmp_path / "merged")
    assert {k: merged[k] for k in COUNTED} == {k: one[k] for k in COUNTED}
    assert json.loads((tmp_path / "merged.report.json").read_text())["documents"] == one["documents"]


def test_shards_without_dedup_merge_by_add_index_with_a_file_tokenizer(tmp_path: Path, corpus: Path, bpe: Path) -> None:
    opts = {"tokenizer": "huggingface", "tokenizer_path": bpe, "progress": False, "workers": 2}
    one = prepare_data(tmp_path / "one", [f"{corpus}/*.jsonl*", corpus / "d.parquet"], **opts)
    for i in range(2):
        prepare_data(tmp_path / "sh", [f"{corpus}/*.jsonl*", corpus / "d.parquet"], shard=(i, 2), **opts)
    merged = merge_data(tmp_path / "sh", tmp_path / "merged")
    _same_dataset(tmp_path / "one", tmp_path / "merged")
    assert merged["tokens"] == one["tokens"] == int(np.sum(IndexedDataset(str(tmp_path / "merged")).sequence_lengths))


def test_a_finished_shard_is_not_redone_after_a_requeue(
    tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["prepare-data", "--input", str(corpus), "--output", str(tmp_path / "sh"), "--shard", "1/2", "--no-progress"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    files = sorted(tmp_path.glob("sh.shard-00001-of-00002.*"))
    stamps = {p: p.stat().st_mtime_ns for p in files}
    assert main(argv) == 0
    again = capsys.readouterr().out
    assert first.startswith("wrote ") and again.startswith("already done, not redone: ")
    assert {p: p.stat().st_mtime_ns for p in files} == stamps
    # other settings are another shard: it is made again
    assert main([*argv, "--min-chars", "20"]) == 0
    assert capsys.readouterr().out.startswith("wrote ")
    # a shard whose data file was lost is made again too
    Path(f"{tmp_path}/sh.shard-00001-of-00002.bin").unlink()
    assert main([*argv, "--min-chars", "20"]) == 0
    assert capsys.readouterr().out.startswith("wrote ")


def test_a_shard_count_that_changes_between_shards_is_refused(
    tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["prepare-data", "--input", str(corpus), "--output", str(tmp_path / "sh"), "--no-progress"]
    assert main([*base, "--shard", "0/4"]) == 0
    capsys.readouterr()
    assert main([*base, "--shard", "1/2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "shard 0/4 of a 4-way split is already there" in err and "this run splits 2 ways; fix:" in err
    assert not list(tmp_path.glob("sh.shard-*-of-00002.*"))
    assert main([*base, "--shard", "4/4"]) == 2
    assert "need 0 <= I < N; fix:" in capsys.readouterr().err


def test_a_merge_refuses_missing_shards_and_mixed_counts(
    tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prepare_data(tmp_path / "sh", [corpus], shard=(0, 3), progress=False)
    prepare_data(tmp_path / "sh", [corpus], shard=(2, 3), progress=False)
    assert main(["merge-data", "--shards", str(tmp_path / "sh"), "--output", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "shard(s) 1 of 3 not finished; fix:" in err
    assert not list(tmp_path.glob("m.*")), "a refused merge writes nothing"
    # a stray report of another split (copied in by hand) is refused at merge too
    stray = tmp_path / "sh.shard-00000-of-00002.report.json"
    stray.write_text((tmp_path / "sh.shard-00000-of-00003.report.json").read_text())
    assert main(["merge-data", "--shards", str(tmp_path / "sh"), "--output", str(tmp_path / "m")]) == 2
    assert "shards of 2 and 3-way splits are mixed; fix:" in capsys.readouterr().err


def test_a_merge_of_shards_made_with_different_tokenizers_names_both(
    tmp_path: Path, corpus: Path, bpe: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prepare_data(tmp_path / "sh", [corpus], shard=(0, 2), progress=False)
    prepare_data(tmp_path / "sh", [corpus], shard=(1, 2), tokenizer="huggingface", tokenizer_path=bpe, progress=False)
    assert main(["merge-data", "--shards", str(tmp_path / "sh"), "--output", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "shard 0/2 was made with tokenizer byte but shard 1/2 with huggingface tokenizer.json (sha256:" in err
    assert "fix: re-run shard 1" in err
    assert not list(tmp_path.glob("m.*"))


def test_gates_keep_the_first_copy_and_count_what_they_drop() -> None:
    gates = DocumentGates(min_chars=5, dedup=True)
    kept = list(gates.filter(["hello world", "hi", "hello world", "other text", "hi", "other text", "third"]))
    assert kept == ["hello world", "other text", "third"]
    assert gates.dropped == {"too_short": 2, "duplicate": 2}
    assert len(gates.kept_digests) == 3 * 16
    plain = DocumentGates()
    assert list(plain.filter(["a", "a"])) == ["a", "a"] and plain.dropped == {"too_short": 0, "duplicate": 0}


def test_the_cli_report_line_names_documents_tokens_and_drops(
    tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["prepare-data", "--input", str(corpus), "--output", str(tmp_path / "o"), "--no-progress", "--dedup"]
    assert main([*argv, "--min-chars", "20"]) == 0
    out = capsys.readouterr().out.strip()
    report = json.loads((tmp_path / "o.report.json").read_text())
    assert f"{report['documents']} documents, {report['tokens']} tokens" in out
    assert f"dropped: {report['dropped']['duplicate']} duplicate, {report['dropped']['too_short']} too_short" in out


def test_more_shards_than_files_leave_empty_shards_that_merge(tmp_path: Path, corpus: Path) -> None:
    files = [corpus / "a.jsonl", corpus / "e.txt"]
    one = prepare_data(tmp_path / "one", files, progress=False)
    reports = [prepare_data(tmp_path / "sh", files, shard=(i, 5), progress=False) for i in range(5)]
    assert sorted(r["documents"] > 0 for r in reports) == [False, False, False, True, True]
    merged = merge_data(tmp_path / "sh", tmp_path / "merged")
    _same_dataset(tmp_path / "one", tmp_path / "merged")
    assert merged["documents"] == one["documents"]


def test_the_on_disk_digest_set_agrees_with_a_set_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """--dedup's digest set is SQLite on disk (bounded memory: bench/dedup_memory.py measured 83 MB
    peak against 450 MB for a Python set on 1 GB of 200-byte documents, 4.0M distinct)."""
    rng = random.Random(3)
    docs = [f"doc {rng.randrange(150_000)}" for _ in range(2 * COMMIT_EVERY + 7)]  # across commits
    seen, disk = set(), DigestSet(tmp_path)
    for doc in docs:
        d = text_digest(doc)
        assert disk.add(d) == (d not in seen)
        seen.add(d)
    disk.close()
    assert list(tmp_path.iterdir()) == []
    gates = DocumentGates(dedup=True, spill_dir=tmp_path)
    assert list(gates.filter(["a", "b", "a"])) == ["a", "b"]
    gates.save_kept_digests(tmp_path / "x.digests")
    assert (tmp_path / "x.digests").read_bytes() == text_digest("a") + text_digest("b")
    assert [p.name for p in tmp_path.iterdir()] == ["x.digests"]

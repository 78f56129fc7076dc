"""prepare-data inputs as teams hold them: .jsonl, .jsonl.gz, .jsonl.zst, Parquet, directories and
globs; truncated compressed files, a Parquet file without the text column; memory that does not grow
with the file. Real files written by gzip, zstandard and pyarrow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.cli import main
from pretrain.data.inputs import expand_inputs
from pretrain.data.prepare import prepare_data
from pretrain.data.sources import ReadStats, read_documents, synthetic_documents
from pretrain.errors import DataError
from tests.helpers import REPO
from tests.prepare_corpus import gated_docs, write_doc_file

FORMATS = ["docs.jsonl", "docs.jsonl.gz", "docs.jsonl.zst", "docs.parquet", "docs.txt.zst", "docs.ndjson.gz"]


@pytest.mark.parametrize("name", FORMATS)
def test_every_format_yields_the_same_documents_and_dataset(tmp_path: Path, name: str) -> None:
    docs = list(synthetic_documents(0.2, seed=5))
    ref = prepare_data(tmp_path / "ref", [write_doc_file(tmp_path / "ref.jsonl", docs)], progress=False)
    path = write_doc_file(tmp_path / name, docs)
    assert list(read_documents([path])) == docs
    got = prepare_data(tmp_path / "got", [path], progress=False)
    assert got["documents"] == ref["documents"] == len(docs)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"got{suffix}").read_bytes() == (tmp_path / f"ref{suffix}").read_bytes()


def test_parquet_reads_the_column_named_by_json_key_across_row_groups(tmp_path: Path) -> None:
    docs = list(synthetic_documents(0.05, seed=6))
    path = write_doc_file(tmp_path / "c.parquet", docs, key="content", row_group=7)
    assert list(read_documents([path], json_key="content")) == docs


def test_directories_and_globs_expand_sorted_whatever_the_creation_order(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    for name in ["z/2.jsonl.zst", "a/10.parquet", "a/9.jsonl", "m.txt", "a/_SUCCESS", "a/.hidden.jsonl", "a/x.bin"]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x")
    assert [p.relative_to(root).as_posix() for p in expand_inputs([root])] == [
        "a/10.parquet",
        "a/9.jsonl",
        "m.txt",
        "z/2.jsonl.zst",
    ]
    globbed = expand_inputs([f"{root}/**/*.jsonl*", root / "m.txt", root / "a" / "9.jsonl"])
    assert [p.relative_to(root).as_posix() for p in globbed] == ["a/9.jsonl", "z/2.jsonl.zst", "m.txt"]
    with pytest.raises(DataError, match=r"matches no file; fix:"):
        expand_inputs([f"{root}/*.nothing"])


def _truncated(tmp_path: Path, name: str) -> tuple[Path, int]:
    path = write_doc_file(tmp_path / name, gated_docs(1, 0.3), frames=1)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path, len(data) // 2


@pytest.mark.parametrize("name", ["t.jsonl.zst", "t.jsonl.gz"])
def test_a_truncated_compressed_file_is_named_with_its_offset_or_skipped_on_request(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path, size = _truncated(tmp_path, name)
    good = write_doc_file(tmp_path / "good.jsonl", ["after the bad file"])
    argv = ["prepare-data", "--input", str(path), str(good), "--output", str(tmp_path / "o"), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and f"at compressed byte {size} " in err
    assert "fix:" in err and "--skip-bad-files" in err
    assert not list(tmp_path.glob("o.*")), "nothing may be published for a failed run"

    stats = ReadStats()
    docs = list(read_documents([path, good], stats=stats, skip_bad_files=True))
    assert docs[-1] == "after the bad file" and len(docs) > 10
    assert stats.bad_files == [
        {"file": str(path), "offset": size, "reason": stats.bad_files[0]["reason"], "documents_kept": len(docs) - 1}
    ]
    assert main([*argv, "--skip-bad-files"]) == 0
    report = json.loads((tmp_path / "o.report.json").read_text())
    assert report["documents"] == len(docs) and report["bad_files"][0]["file"] == str(path)


def test_a_corrupt_zst_frame_is_a_bad_file_not_a_crash(tmp_path: Path) -> None:
    path = write_doc_file(tmp_path / "c.jsonl.zst", gated_docs(2, 0.1), frames=1)
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"c\.jsonl\.zst: .* at compressed byte \d+ after \d+ documents; fix:"):
        list(read_documents([path]))


def test_a_parquet_file_without_the_text_column_is_one_line_with_the_columns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_doc_file(tmp_path / "p.parquet", ["a document"], key="content")
    assert main(["prepare-data", "--input", str(path), "--output", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{path}: no column 'text' (columns: id, content); fix: pass --json-key" in err


_PEAK = """
import sys, tracemalloc
import pyarrow, zstandard
from pretrain.data.sources import read_documents
tracemalloc.start()
if sys.argv[1] == "whole":  # the probe's control: a reader that holds the whole text
    n = len(zstandard.ZstdDecompressor().stream_reader(open(sys.argv[2], "rb")).read().decode())
else:
    n = sum(len(d) for d in read_documents(sys.argv[2:]))
# Python's allocations (tracemalloc) and Arrow's (its own memory pool), at their peaks
print(n, (tracemalloc.get_traced_memory()[1] + pyarrow.default_memory_pool().max_memory()) >> 20)
"""


def test_reading_large_compressed_and_parquet_files_keeps_memory_flat(tmp_path: Path) -> None:
    """~60 MB of text per file; the reader's peak memory stays a small fraction of that. Peak RSS is
    not used: this sandbox's kernel updates it late (a 130 MB read showed no growth)."""
    doc = " ".join(synthetic_documents(0.004, seed=1))  # ~4 KB
    docs = [f"{i} {doc}" for i in range(15_000)]
    files = [write_doc_file(tmp_path / n, docs, frames=40, row_group=250) for n in ("big.jsonl.zst", "big.parquet")]
    text_mb = sum(len(d) for d in docs) / 2**20
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    grown = {}
    for mode, path in [("stream", files[0]), ("stream", files[1]), ("whole", files[0])]:
        cmd = [sys.executable, "-c", _PEAK, mode, str(path)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        chars, grown[mode, path.name] = map(int, out.stdout.split())
        assert chars >= sum(len(d) for d in docs)
    assert grown["whole", "big.jsonl.zst"] > text_mb, f"the probe cannot see a whole-file reader: {grown}"
    for name in ("big.jsonl.zst", "big.parquet"):
        assert grown["stream", name] < min(16, text_mb / 4), f"{name}: {grown} MB grown for {text_mb:.0f} MB of text"

"""Which files a preparation reads, and which of them one shard reads.

Contract: :func:`expand_inputs` turns ``--input`` arguments (files, directories, glob patterns) into
one list of files, the same on every machine that sees the same tree: arguments in the order given,
a directory's readable files (:func:`is_input_file`: text, JSONL, Parquet, optionally ``.gz``/``.zst``;
names starting with ``.`` or ``_`` such as ``_SUCCESS`` skipped) and a glob's matches each sorted by
path. A file listed twice is read once (the first place). :func:`shard_files` is shard ``index`` of
``count`` of that list: contiguous runs of files, cut where the cumulative size passes ``k/count`` of
the total (a file belongs to the shard its middle byte falls in), so the shards read in order are
exactly the one-machine input. :func:`inputs_digest` identifies the list (paths and sizes), so that
shards of different inputs are never merged. It reads no file contents (that is
:mod:`pretrain.data.sources`).
"""

from __future__ import annotations

import glob
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from pretrain.errors import DataError

_FORMAT_SUFFIXES = (".txt", ".text", ".md", ".jsonl", ".ndjson", ".json", ".parquet")
_GLOB_CHARS = set("*?[")


def is_input_file(path: Path) -> bool:
    """A file a directory contributes: a known text/JSONL/Parquet suffix, optionally compressed."""
    if path.name.startswith((".", "_")) or not path.is_file():
        return False
    name = path.name.lower()
    for compression in ("", ".gz", ".zst"):
        if any(name.endswith(fmt + compression) for fmt in _FORMAT_SUFFIXES if fmt != ".parquet" or not compression):
            return True
    return False


def expand_inputs(args: Sequence[Path | str]) -> list[Path]:
    """Files, directories (recursively) and globs -> a deterministic file list (see module docstring)."""
    files: list[Path] = []
    seen: set[Path] = set()
    for arg in args:
        text = str(arg)
        if _GLOB_CHARS & set(text) and not Path(text).exists():
            found = [Path(p) for p in sorted(glob.glob(text, recursive=True)) if Path(p).is_file()]
            if not found:
                raise DataError(f"{text}: the pattern matches no file; fix: check the pattern (quote it for the shell)")
        elif Path(text).is_dir():
            found = sorted(p for p in Path(text).rglob("*") if is_input_file(p))
            if not found:
                raise DataError(
                    f"{text}: directory without text, JSONL or Parquet files; fix: point --input at the corpus files"
                )
        elif Path(text).is_file():
            found = [Path(text)]
        else:
            raise DataError(f"{text}: no such input file or directory; fix: pass existing files, directories or globs")
        for path in found:
            if path.resolve() not in seen:
                seen.add(path.resolve())
                files.append(path)
    return files


def parse_shard(spec: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N) with 0 <= I < N; ValueError says what is wrong."""
    try:
        index, count = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"--shard {spec!r} is not I/N; fix: e.g. --shard 0/4 (I counts from 0)") from None
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"--shard {spec!r}: need 0 <= I < N; fix: I counts from 0 to N-1 (Slurm/K8s array index)")
    return index, count


def shard_files(files: Sequence[Path], index: int, count: int) -> list[Path]:
    """The contiguous run of ``files`` that shard ``index`` of ``count`` reads (by cumulative size)."""
    sizes = [max(p.stat().st_size, 1) for p in files]
    total = sum(sizes)
    chosen, before = [], 0
    for path, size in zip(files, sizes):
        if (2 * before + size) * count // (2 * total) == index:  # the file's middle byte
            chosen.append(path)
        before += size
    return chosen


def inputs_digest(files: Sequence[Path]) -> str:
    """SHA-256 of the file list: each path as given and its size."""
    listing = [[str(p), p.stat().st_size] for p in files]
    return "sha256:" + hashlib.sha256(json.dumps(listing).encode()).hexdigest()

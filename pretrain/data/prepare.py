"""``pretrain prepare-data`` and ``merge-data``: documents -> Megatron indexed dataset (``PREFIX.bin``/``.idx``).

Contract: :func:`build_indexed_dataset` tokenizes documents with any tokenizer of
:mod:`pretrain.data.tokenizer_files` (byte by default) in ``workers`` processes, appends the
end-of-document id to each, and writes Megatron's indexed dataset with megatron-core's own
``IndexedDatasetBuilder`` (the format Megatron-LM's ``preprocess_data.py`` writes, so either
reads the other's) in the dtype Megatron picks for the vocabulary (:func:`token_dtype`: uint16
below 65500, else int32). The output is identical for any number of workers. The files appear
only when complete (written under temporary names, then renamed); an input without documents is
a one-line :class:`DataError` (an empty shard is allowed). :func:`prepare_data` is the command:
files, directories and globs (:mod:`pretrain.data.inputs`) in any format of
:mod:`pretrain.data.sources`, or a synthetic corpus, through the gates of :mod:`pretrain.data.gates`,
with a progress bar (MB/s) on stderr and a report (``PREFIX.report.json``: documents, tokens,
dropped and why); with ``shard=(I, N)`` it prepares shard I of N (:mod:`pretrain.data.shards`),
and returns at once when that shard is already done with the same settings. :func:`merge_data`
merges the shards. :func:`check_token_ids` refuses a dataset with ids outside a vocabulary;
:func:`dataset_snapshot_id` is a dataset's identity.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
from tqdm import tqdm

from pretrain.data import shards
from pretrain.data.encode import encode_documents
from pretrain.data.gates import DocumentGates
from pretrain.data.inputs import expand_inputs, inputs_digest, shard_files
from pretrain.data.sources import READ_CHUNK_BYTES, ReadStats, read_documents, synthetic_documents
from pretrain.data.tokenizer_files import open_codec
from pretrain.errors import DataError
from tiering.system.fsio import atomic_write_bytes


def token_dtype(vocab_size: int) -> type[np.number]:
    """The dtype Megatron stores token ids of this vocabulary in (uint16 below 65500, else int32)."""
    return DType.optimal_dtype(vocab_size)


def build_indexed_dataset(
    documents: Iterable[str],
    output_prefix: Path | str,
    tokenizer: str = "byte",
    tokenizer_path: Path | str | None = None,
    workers: int = 1,
    progress: bool = False,
    source: str = "the input",
    allow_empty: bool = False,
) -> dict[str, int]:
    """Tokenize ``documents`` and write ``PREFIX.bin``/``.idx``; return the document and token counts."""
    prefix = Path(output_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    codec = open_codec(tokenizer, tokenizer_path)
    final = {suffix: Path(f"{prefix}{suffix}") for suffix in (".bin", ".idx")}
    tmp = {suffix: Path(f"{prefix}{suffix}.tmp-{os.getpid()}") for suffix in final}
    builder = IndexedDatasetBuilder(str(tmp[".bin"]), dtype=token_dtype(codec.vocab_size))
    docs = tokens = text_bytes = 0
    bar = tqdm(
        desc=f"tokenizing ({tokenizer})",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not progress,
        file=sys.stderr,
        mininterval=0.5,
    )
    try:
        with bar:
            for batch in encode_documents(documents, tokenizer, tokenizer_path, workers):
                for ids in batch.documents():
                    builder.add_document(ids, [len(ids)])
                docs += len(batch.lengths)
                tokens += int(batch.lengths.sum())
                text_bytes += batch.text_bytes
                bar.update(batch.text_bytes)
                bar.set_postfix(documents=docs, refresh=False)
        if docs == 0 and not allow_empty:
            raise DataError(
                f"{source}: no documents (every file is empty or blank); fix: give text with a non-blank "
                "paragraph or JSONL lines with text"
            )
        builder.finalize(str(tmp[".idx"]))
        for suffix in (".bin", ".idx"):
            os.replace(tmp[suffix], final[suffix])
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
    return {"documents": docs, "tokens": tokens, "text_bytes": text_bytes, "vocab_size": codec.vocab_size}


def prepare_data(
    output_prefix: Path | str,
    inputs: Sequence[Path | str] = (),
    synthetic_mb: float | None = None,
    seed: int = 0,
    tokenizer: str = "byte",
    tokenizer_path: Path | str | None = None,
    json_key: str = "text",
    skip_bad_lines: bool = False,
    workers: int = 1,
    progress: bool = True,
    *,
    shard: tuple[int, int] | None = None,
    skip_bad_files: bool = False,
    min_chars: int = 0,
    dedup: bool = False,
    read_chunk_bytes: int = READ_CHUNK_BYTES,
) -> dict[str, Any]:
    """``pretrain prepare-data``: the inputs' (or a synthetic corpus's) documents -> indexed dataset and
    report; with ``shard``, shard I of N (``skipped`` is true when it was already done)."""
    stats = ReadStats()
    gates = DocumentGates(min_chars, dedup, spill_dir=Path(output_prefix).parent)
    if synthetic_mb is not None and shard is not None:
        raise DataError("--synthetic-mb with --shard: a synthetic corpus is not split; fix: drop --shard")
    if synthetic_mb is not None:
        files: list[Path] = []
        docs, source = synthetic_documents(synthetic_mb, seed), f"--synthetic-mb {synthetic_mb}"
        identity_of_inputs = f"synthetic:{synthetic_mb}:{seed}"
    else:
        files = expand_inputs(inputs)
        identity_of_inputs = inputs_digest(files)
    settings = {
        "inputs": identity_of_inputs,
        "tokenizer": open_codec(tokenizer, tokenizer_path).identity(),
        "gates": gates.settings(),
        "json_key": json_key,
        "skip_bad_lines": skip_bad_lines,
        "skip_bad_files": skip_bad_files,
        "shard": list(shard) if shard else None,
    }
    prefix = Path(output_prefix)
    if shard is not None:
        shards.check_shard_count(output_prefix, shard[1])
        prefix = shards.shard_prefix(output_prefix, *shard)
        done = shards.finished_report(prefix, settings, dataset_snapshot_id)
        if done is not None:
            return {**done, "prefix": str(prefix), "skipped": True}
        files = shard_files(files, *shard)
    if synthetic_mb is None:
        docs = read_documents(files, json_key, skip_bad_lines, stats, skip_bad_files, read_chunk_bytes)
        source = ", ".join(map(str, files[:3])) + (f" (+{len(files) - 3} more)" if len(files) > 3 else "")
    started = time.perf_counter()
    try:
        counts = build_indexed_dataset(
            gates.filter(docs), prefix, tokenizer, tokenizer_path, workers, progress, source, shard is not None
        )
        if dedup:
            gates.save_kept_digests(shards.digests_path(prefix))
    finally:
        gates.close()
    report = {
        "settings": settings,
        "documents": counts["documents"],
        "tokens": counts["tokens"],
        "text_bytes": counts["text_bytes"],
        "dropped": {**gates.dropped, "bad_lines": stats.skipped_lines},
        "bad_files": stats.bad_files,
        "files": len(files),
        "snapshot": dataset_snapshot_id(prefix),
        "seconds": round(time.perf_counter() - started, 3),  # read, gate, tokenize, write (not start-up)
    }
    if shard is not None:  # another split may have started meanwhile: never publish a mixed set
        shards.check_shard_count(output_prefix, shard[1])
    shards.write_report(prefix, report)
    return {**report, "prefix": str(prefix), "skipped": False, "skipped_lines": stats.skipped_lines}


def merge_data(shard_base: Path | str, output_prefix: Path | str) -> dict[str, Any]:
    """``pretrain merge-data``: every shard of ``shard_base`` -> one dataset at ``output_prefix``."""
    report = shards.merge_shards(shard_base, output_prefix)
    report["snapshot"] = dataset_snapshot_id(output_prefix)
    shards.write_report(output_prefix, report)
    return report


def check_token_ids(prefix: Path | str, vocab_size: int) -> int:
    """The largest token id of the dataset; DataError (one line) if it is >= ``vocab_size``."""
    bin_path = f"{prefix}.bin"
    for path in (bin_path, f"{prefix}.idx"):
        if not Path(path).is_file():
            raise DataError(f"{path}: dataset file not found; fix: run 'pretrain prepare-data --output {prefix} ...'")
    dtype = IndexedDataset(str(prefix)).index.dtype
    ids = np.memmap(bin_path, dtype=dtype, mode="r")
    largest = int(ids.max()) if ids.size else -1
    if largest >= vocab_size:
        raise DataError(
            f"{bin_path}: token id {largest} >= vocabulary size {vocab_size}; fix: use the tokenizer the data "
            "was prepared with, or re-run pretrain prepare-data with this tokenizer"
        )
    return largest


def checked_token_ids(prefix: Path | str, vocab_size: int) -> int:
    """:func:`check_token_ids`, remembered next to the dataset (``PREFIX.maxid.json``, keyed by the
    dataset's identity) so that a restart does not scan the whole ``.bin`` again (it would add to
    every recovery). A sidecar that cannot be written (read-only data) only costs the next scan."""
    sidecar = Path(f"{prefix}.maxid.json")
    identity = dataset_snapshot_id(prefix)
    try:
        known = json.loads(sidecar.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    if known.get("snapshot") == identity and isinstance(known.get("max_token_id"), int):
        largest = known["max_token_id"]
        if largest >= vocab_size:
            raise DataError(
                f"{prefix}.bin: token id {largest} >= vocabulary size {vocab_size}; fix: use the tokenizer the "
                "data was prepared with, or re-run pretrain prepare-data with this tokenizer"
            )
        return largest
    largest = check_token_ids(prefix, vocab_size)
    with contextlib.suppress(OSError):
        atomic_write_bytes(sidecar, json.dumps({"snapshot": identity, "max_token_id": largest}).encode())
    return largest


def dataset_snapshot_id(prefix: Path | str) -> str:
    """Identity of a prepared dataset: SHA-256 of its index file (document boundaries and sizes).
    Hashed once per process and version of the file (start-up asks twice: the token-id check and
    the checkpoint's dataset snapshot)."""
    idx = Path(str(prefix) + ".idx")
    st = idx.stat()
    return _idx_digest(str(idx.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _idx_digest(path: str, inode: int, size: int, mtime_ns: int) -> str:
    return "sha256:" + hashlib.sha256(Path(path).read_bytes()).hexdigest()

"""Corpus files for the prepare-data tests, written by the real libraries (gzip, zstandard, pyarrow):
the same documents in every format, and a multi-file corpus with duplicates and short documents."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from pretrain.data.sources import is_jsonl, synthetic_documents


def jsonl_bytes(docs: list[str], key: str = "text") -> bytes:
    return "".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()


def write_doc_file(path: Path, docs: list[str], key: str = "text", frames: int = 3, row_group: int = 50) -> Path:
    """``docs`` in the format ``path``'s suffix names; .zst in ``frames`` frames, Parquet in row groups."""
    name = path.name
    if name.endswith(".parquet"):
        pq.write_table(pa.table({"id": list(range(len(docs))), key: docs}), path, row_group_size=row_group)
        return path
    raw = jsonl_bytes(docs, key) if is_jsonl(name) else ("\n\n".join(docs) + "\n").encode()
    if name.endswith(".gz"):
        raw = gzip.compress(raw)
    elif name.endswith(".zst"):
        # several frames, as parallel compressors (pzstd, zstd -T) write them
        step = max(1, len(raw) // frames)
        raw = b"".join(zstandard.ZstdCompressor().compress(raw[i : i + step]) for i in range(0, len(raw), step))
    path.write_bytes(raw)
    return path


def gated_docs(seed: int, mb: float = 0.05) -> list[str]:
    """Synthetic documents with exact duplicates (near and far) and a few short ones."""
    docs = list(synthetic_documents(mb, seed=seed))
    out = []
    for i, doc in enumerate(docs):
        out.append(doc)
        if i % 7 == 3:
            out.append(doc)  # a duplicate right after
        if i % 11 == 5:
            out.append("too short")
    out.append(docs[0])  # a duplicate at the far end
    return out


def write_corpus(root: Path) -> list[Path]:
    """Six files in four formats whose documents repeat across files (for shard-spanning duplicates)."""
    root.mkdir(parents=True, exist_ok=True)
    names = ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet", "e.txt", "f.jsonl.zst"]
    shared = gated_docs(99, 0.01)
    files = []
    for i, name in enumerate(names):
        docs = gated_docs(i, 0.02 + 0.01 * i)
        if i % 2:
            docs = docs + shared  # the same documents in several files
        files.append(write_doc_file(root / name, docs))
    return files

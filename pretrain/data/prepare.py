"""``pretrain prepare-data``: text files -> Megatron indexed dataset (``PREFIX.bin``/``PREFIX.idx``)."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from pretrain.data.tokenizer import ByteTokenizer

_WORDS = (  # noqa: SIM905 - a word list reads best as one string
    "the of and to in is was for on that with as by at from his her it an were are which this be "
    "checkpoint gradient rank node failure restart shard manifest tensor pipeline parallel optimizer "
    "model data loss step token batch cluster storage replica durable verify commit recovery train "
    "river mountain city music history science language garden winter summer ocean forest bridge"
).split()


def documents_from_files(paths: Iterable[Path]) -> Iterator[str]:
    """One document per blank-line separated paragraph."""
    for path in paths:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        for para in text.split("\n\n"):
            para = para.strip()
            if para:
                yield para


def synthetic_documents(megabytes: float, seed: int = 0) -> Iterator[str]:
    """A deterministic English-like corpus for demos and tests (no download)."""
    rng = random.Random(seed)
    produced = 0
    target = int(megabytes * 1024 * 1024)
    while produced < target:
        sentences = []
        for _ in range(rng.randint(2, 8)):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 18))]
            sentences.append(" ".join(words).capitalize() + ".")
        doc = " ".join(sentences)
        produced += len(doc) + 1
        yield doc


def build_indexed_dataset(documents: Iterable[str], output_prefix: Path | str) -> dict[str, int]:
    """Tokenize with the byte tokenizer and write ``.bin``/``.idx``; return counts."""
    prefix = Path(output_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tok = ByteTokenizer()
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    docs = tokens = 0
    for doc in documents:
        ids = tok.tokenize(doc) + [tok.eod]
        builder.add_document(ids, [len(ids)])
        docs += 1
        tokens += len(ids)
    if docs == 0:
        raise ValueError("no documents found in the input; give non-empty text files")
    builder.finalize(str(prefix) + ".idx")
    return {"documents": docs, "tokens": tokens}


def dataset_snapshot_id(prefix: Path | str) -> str:
    """Identity of a prepared dataset: SHA-256 of its index file (document boundaries and sizes)."""
    digest = hashlib.sha256(Path(str(prefix) + ".idx").read_bytes())
    return "sha256:" + digest.hexdigest()

"""Tokenize documents in batches, in worker processes, in input order.

Contract: :func:`encode_documents` yields one :class:`EncodedBatch` per ``batch_size`` documents,
in the order of the input, whatever ``workers`` is: the ids of each document followed by the
tokenizer's end-of-document id, so the output is identical for any number of workers. With
``workers > 1`` a ``multiprocessing`` pool (spawn: no forked torch or tokenizer threads) maps the
batches, each worker opening the tokenizer once. Batches are submitted through a window of
``4 * workers`` (``apply_async``, results taken in submission order) rather than ``Pool.imap``,
whose feeder thread would read the whole input into memory ahead of the workers.
This module imports no torch or Megatron, so spawned workers start in a fraction of a second.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.pool import AsyncResult
from pathlib import Path

import numpy as np

from pretrain.data.tokenizer_files import Codec, open_codec


@dataclass
class EncodedBatch:
    """Token ids of consecutive documents: ``ids`` concatenated, ``lengths`` per document."""

    ids: np.ndarray  # int64, each document's ids followed by the end-of-document id
    lengths: np.ndarray  # int64
    text_bytes: int  # UTF-8 bytes of the batch's text, for progress

    def documents(self) -> Iterator[np.ndarray]:
        start = 0
        for length in self.lengths.tolist():
            yield self.ids[start : start + length]
            start += length


_worker_codec: Codec | None = None


def _init_worker(kind: str, path: str | None) -> None:
    global _worker_codec
    # One worker per core already: the Rust tokenizer's own thread pool would oversubscribe them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_codec = open_codec(kind, path)


def _encode_in_worker(batch: list[str]) -> EncodedBatch:
    assert _worker_codec is not None, "worker not initialized"
    return encode_batch(_worker_codec, batch)


def encode_batch(codec: Codec, batch: list[str]) -> EncodedBatch:
    """Each document's ids followed by the end-of-document id."""
    encoded = codec.encode_batch(batch)
    lengths = np.fromiter((len(ids) + 1 for ids in encoded), dtype=np.int64, count=len(encoded))
    ids = np.fromiter(
        itertools.chain.from_iterable(itertools.chain(ids, (codec.eod,)) for ids in encoded),
        dtype=np.int64,
        count=int(lengths.sum()),
    )
    return EncodedBatch(ids, lengths, sum(len(doc.encode("utf-8")) for doc in batch))


BATCH_BYTES = 1 << 20  # a batch also ends at ~1 MiB of text: work spreads over the workers even
# when a corpus has few, long documents (source files, books)


def batched(documents: Iterable[str], size: int, max_bytes: int = BATCH_BYTES) -> Iterator[list[str]]:
    """Consecutive documents, at most ``size`` of them or about ``max_bytes`` of text per batch."""
    batch: list[str] = []
    held = 0
    for doc in documents:
        batch.append(doc)
        held += len(doc)
        if len(batch) >= size or held >= max_bytes:
            yield batch
            batch, held = [], 0
    if batch:
        yield batch


def encode_documents(
    documents: Iterable[str],
    kind: str = "byte",
    path: str | Path | None = None,
    workers: int = 1,
    batch_size: int = 256,
) -> Iterator[EncodedBatch]:
    """Tokenized batches of ``documents`` in input order (identical for any ``workers``)."""
    if workers < 1 or batch_size < 1:
        raise ValueError(f"workers={workers} and batch_size={batch_size} must be >= 1")
    codec = open_codec(kind, path)  # here first: a bad file must fail once, not in every worker
    batches = batched(documents, batch_size)
    if workers == 1:
        for batch in batches:
            yield encode_batch(codec, batch)
        return
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(kind, str(path) if path else None)) as pool:
        pending: deque[AsyncResult[EncodedBatch]] = deque()
        for batch in batches:
            pending.append(pool.apply_async(_encode_in_worker, (batch,)))
            if len(pending) >= 4 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

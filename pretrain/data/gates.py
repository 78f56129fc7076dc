"""Document gates before tokenization: minimum length and exact-duplicate removal, with the tally.

Contract: :class:`DocumentGates` filters a stream of documents in order: a document shorter than
``min_chars`` characters is dropped (``too_short``); with ``dedup``, a document whose exact text was
already kept is dropped (``duplicate``). The first occurrence is the one kept, so the result is the
same however the input is later cut into shards, provided the merge drops a shard's documents that
an earlier shard kept (:func:`pretrain.data.shards.merge_shards` does, from :attr:`kept_digests`).
Each kept document's 128-bit digest (xxh3-128 of its UTF-8 text) is kept in order when ``dedup``
is on: 16 bytes per document plus the set that looks them up (about 100 bytes per distinct
document in all). It never reads files or tokenizes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import xxhash

DIGEST_BYTES = 16


def text_digest(text: str) -> bytes:
    """The 16-byte identity of a document's exact text."""
    return xxhash.xxh3_128_digest(text.encode("utf-8"))


@dataclass
class DocumentGates:
    """Minimum length and optional exact-duplicate removal; counts what it drops and why."""

    min_chars: int = 0
    dedup: bool = False
    dropped: dict[str, int] = field(default_factory=lambda: {"too_short": 0, "duplicate": 0})
    kept_digests: bytearray = field(default_factory=bytearray)
    _seen: set[bytes] = field(default_factory=set, repr=False)

    def settings(self) -> dict[str, object]:
        return {"min_chars": self.min_chars, "dedup": self.dedup}

    def filter(self, documents: Iterable[str]) -> Iterator[str]:
        for doc in documents:
            if len(doc) < self.min_chars:
                self.dropped["too_short"] += 1
                continue
            if self.dedup:
                digest = text_digest(doc)
                if digest in self._seen:
                    self.dropped["duplicate"] += 1
                    continue
                self._seen.add(digest)
                self.kept_digests += digest
            yield doc

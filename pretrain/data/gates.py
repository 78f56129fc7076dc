"""Document gates before tokenization: minimum length and exact-duplicate removal, with the tally.

Contract: :class:`DocumentGates` filters a stream of documents in order: a document shorter than
``min_chars`` characters is dropped (``too_short``); with ``dedup``, a document whose exact text was
already kept is dropped (``duplicate``). The first occurrence is the one kept, so the result is the
same however the input is later cut into shards, provided the merge drops a shard's documents that
an earlier shard kept (:func:`pretrain.data.shards.merge_shards` does, from the kept digests).

Memory is bounded whatever the corpus: the digests seen (xxh3-128 of each kept document's UTF-8
text) live in :class:`DigestSet`, an SQLite table on disk with a fixed page cache (``CACHE_MB``),
and the kept digests, in order, are appended to a spill file next to the output
(:meth:`DocumentGates.save_kept_digests` moves it into place). A CPython ``set`` held about 100
bytes per distinct document (500M documents: ~50 GB). Gates never read inputs or tokenize.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

DIGEST_BYTES = 16
CACHE_MB = 64  # SQLite's page cache per digest set: the bound on what the lookups hold in memory
COMMIT_EVERY = 100_000  # inserts per transaction (one journal-less commit each)


def text_digest(text: str) -> bytes:
    """The 16-byte identity of a document's exact text."""
    return xxhash.xxh3_128_digest(text.encode("utf-8"))


class DigestSet:
    """A set of 16-byte digests on disk (SQLite, no journal, no fsync: scratch that dies with the
    job) in a private directory under ``where``; ``add`` says whether a digest was new."""

    def __init__(self, where: Path | str | None = None) -> None:
        base = Path(where) if where is not None else Path(tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=".digests-", dir=base))
        self._db = sqlite3.connect(self.dir / "seen.sqlite", isolation_level=None)
        for pragma in ("journal_mode=OFF", "synchronous=OFF", f"cache_size=-{CACHE_MB * 1024}", "temp_store=FILE"):
            self._db.execute(f"PRAGMA {pragma}")
        self._db.execute("CREATE TABLE d (k BLOB PRIMARY KEY) WITHOUT ROWID")
        self._db.execute("BEGIN")
        self._pending = 0

    def add(self, digest: bytes) -> bool:
        """True if ``digest`` was not in the set (it is now)."""
        new = self._db.execute("INSERT OR IGNORE INTO d VALUES (?)", (digest,)).rowcount == 1
        self._pending += 1
        if self._pending >= COMMIT_EVERY:
            self._db.execute("COMMIT")
            self._db.execute("BEGIN")
            self._pending = 0
        return new

    def close(self) -> None:
        self._db.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class DocumentGates:
    """Minimum length and optional exact-duplicate removal; counts what it drops and why.
    ``spill_dir``: where the digest set and the kept digests go (default: the system temp dir;
    prepare-data passes the output's directory, which has the room)."""

    min_chars: int = 0
    dedup: bool = False
    spill_dir: Path | None = None
    dropped: dict[str, int] = field(default_factory=lambda: {"too_short": 0, "duplicate": 0})
    _seen: DigestSet | None = field(default=None, repr=False)
    _kept: Path | None = field(default=None, repr=False)

    def settings(self) -> dict[str, object]:
        return {"min_chars": self.min_chars, "dedup": self.dedup}

    @property
    def kept_digests(self) -> bytes:
        """The kept documents' digests in order (read back from the spill file: small inputs only)."""
        return self._kept.read_bytes() if self._kept is not None else b""

    def filter(self, documents: Iterable[str]) -> Iterator[str]:
        if self.dedup and self._seen is None:
            self._seen = DigestSet(self.spill_dir)
            self._kept = self._seen.dir / "kept.digests"
        kept = open(self._kept, "ab") if self._kept is not None else None  # noqa: SIM115 (closed below)
        try:
            for doc in documents:
                if len(doc) < self.min_chars:
                    self.dropped["too_short"] += 1
                    continue
                if self._seen is not None and kept is not None:
                    digest = text_digest(doc)
                    if not self._seen.add(digest):
                        self.dropped["duplicate"] += 1
                        continue
                    kept.write(digest)
                yield doc
        finally:
            if kept is not None:
                kept.close()

    def save_kept_digests(self, path: Path) -> None:
        """Move the kept digests to ``path`` (durably, in one rename) and drop the digest set."""
        if self._kept is None or self._seen is None:
            raise RuntimeError("save_kept_digests without a dedup filter run")  # a programming error
        with open(self._kept, "rb+") as f:
            os.fsync(f.fileno())
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        shutil.move(str(self._kept), tmp)  # a rename on the same volume (spill_dir: the output's)
        os.replace(tmp, path)
        self.close()

    def close(self) -> None:
        if self._seen is not None:
            self._seen.close()

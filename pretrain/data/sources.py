"""Documents from input files: plain text, JSONL (plain, ``.gz``, ``.zst``) and Parquet.

Contract: :func:`read_documents` yields document strings from files in order, streaming: a file
is never read whole. Memory is bounded by ``read_chunk_bytes`` (compressed input is read, and text
decompressed, about that much at a time), the longest line, and for Parquet one row group's text
column (a property of the file, typically 64-128 MB, never its size). The format is the suffix:
``.parquet`` is Parquet with the text in the column ``json_key``; one of :data:`JSONL_SUFFIXES`
(after an optional ``.gz``/``.zst``) is JSONL, Megatron's convention: one JSON object per line
with the text under ``json_key``; blank lines and empty texts are no documents. Any other file
(optionally ``.gz``/``.zst``) is UTF-8 text (undecodable bytes replaced), split at empty lines,
each paragraph stripped.

Errors are one-line :class:`DataError` naming the file and the fix: a JSONL line that is not a JSON
object with a string ``json_key`` (``file:line``; skipped and counted with ``skip_bad_lines``), a
truncated or corrupt compressed file (the compressed offset reached; with ``skip_bad_files`` the
documents read before the break are kept, the rest of the file is skipped and recorded in
:class:`ReadStats`), a Parquet file without the column. Which files to read (directories, globs,
shards) is :mod:`pretrain.data.inputs`; this module never decides that. :func:`synthetic_documents`
is a deterministic English-like corpus for demos and tests.
"""

from __future__ import annotations

import gzip
import io
import json
import random
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import BinaryIO

from pretrain.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
COMPRESSED_SUFFIXES = (".gz", ".zst")
PARQUET_SUFFIX = ".parquet"
READ_CHUNK_BYTES = 1 << 20  # compressed bytes read at a time

_WORDS = (  # noqa: SIM905 - a word list reads best as one string
    "the of and to in is was for on that with as by at from his her it an were are which this be "
    "checkpoint gradient rank node failure restart shard manifest tensor pipeline parallel optimizer "
    "model data loss step token batch cluster storage replica durable verify commit recovery train "
    "river mountain city music history science language garden winter summer ocean forest bridge"
).split()


@dataclass
class ReadStats:
    """What reading the inputs met besides documents."""

    skipped_lines: int = 0  # bad JSONL lines skipped (skip_bad_lines)
    bad_files: list[dict[str, object]] = field(default_factory=list)  # skipped tails (skip_bad_files)


class BadCompressedFile(Exception):
    """A compressed stream that ends early or does not decode; ``offset`` is where reading stopped."""

    def __init__(self, reason: str, offset: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.offset = offset


def _suffixes(path: Path | str) -> tuple[str, str]:
    """(compression suffix or "", format suffix) of a file name, lower case."""
    p = Path(path)
    last = p.suffix.lower()
    if last in COMPRESSED_SUFFIXES:
        return last, Path(p.stem).suffix.lower()
    return "", last


def is_jsonl(path: Path | str) -> bool:
    return _suffixes(path)[1] in JSONL_SUFFIXES


def is_parquet(path: Path | str) -> bool:
    return _suffixes(path) == ("", PARQUET_SUFFIX)


class _ZstdReader(io.RawIOBase):
    """Decompresses every zstd frame of a file in turn; a file that ends inside a frame (or does not
    decode) raises :class:`BadCompressedFile`. ``zstandard``'s own ``stream_reader`` ends quietly at
    a truncated frame, which would lose the tail of a file without a word. Its ``decompressobj`` has
    no output limit, so the compressed input is fed in pieces sized by the compression ratio seen so
    far: each piece yields about ``chunk_bytes`` of text, whatever the ratio (text reaches 100x)."""

    _MIN_PIECE = 1 << 10

    def __init__(self, raw: BinaryIO, chunk_bytes: int, zstandard: ModuleType) -> None:
        super().__init__()
        self._raw = raw
        self._chunk = chunk_bytes
        self._piece = self._MIN_PIECE  # grows (at most 2x a step) while the ratio allows
        self._zstd_error = zstandard.ZstdError
        self._dctx = zstandard.ZstdDecompressor()
        self._obj = self._dctx.decompressobj()
        self._in_frame = False
        self._pending = memoryview(b"")  # compressed, not yet fed
        self._out = memoryview(b"")  # decompressed, not yet returned

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        while not self._out:
            if not self._pending:
                self._pending = memoryview(self._raw.read(self._chunk))
                if not self._pending:
                    if self._in_frame:
                        raise BadCompressedFile("the file ends inside a zstd frame (truncated)", self._raw.tell())
                    return 0
            piece, self._pending = self._pending[: self._piece], self._pending[self._piece :]
            self._out = memoryview(self._decompress(bytes(piece)))
            ratio = max(1.0, len(self._out) / len(piece))
            self._piece = max(self._MIN_PIECE, min(self._chunk, 2 * len(piece), int(self._chunk / ratio)))
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _decompress(self, data: bytes) -> bytes:
        pieces = []
        while data:
            try:
                pieces.append(self._obj.decompress(data))
            except self._zstd_error as exc:
                offset = self._raw.tell() - len(self._pending)
                raise BadCompressedFile(f"not a valid zstd stream ({exc})", offset) from None
            self._in_frame = not self._obj.eof
            data = self._obj.unused_data if self._obj.eof else b""
            if self._obj.eof:
                self._obj = self._dctx.decompressobj()
        return b"".join(pieces)


class _GzipReader(io.RawIOBase):
    """``gzip`` with its errors (truncation, bad CRC, bad data) as :class:`BadCompressedFile`."""

    def __init__(self, raw: BinaryIO) -> None:
        super().__init__()
        self._raw = raw
        self._gz = gzip.GzipFile(fileobj=raw, mode="rb")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        try:
            # read1: one step of decompression, so the text before a break is delivered before the error
            data = self._gz.read1(len(buffer))
        except EOFError:
            raise BadCompressedFile("the file ends inside the gzip stream (truncated)", self._raw.tell()) from None
        except (gzip.BadGzipFile, zlib.error) as exc:
            raise BadCompressedFile(f"not a valid gzip stream ({exc})", self._raw.tell()) from None
        buffer[: len(data)] = data
        return len(data)


def _zstandard(path: Path | str) -> ModuleType:
    """The ``zstandard`` module, imported only when a ``.zst`` file is read."""
    try:
        # deferred: only .zst input needs it; the rank program imports this module and must not
        # (the GPU machine has no zstandard wheel, and the trainer reads no .zst)
        import zstandard
    except ImportError:
        raise DataError(f"{path}: reading .zst input needs the zstandard package; fix: pip install zstandard") from None
    return zstandard


def open_binary(raw: BinaryIO, path: Path | str, chunk_bytes: int = READ_CHUNK_BYTES) -> BinaryIO:
    """The decompressed bytes of ``raw`` (opened from ``path``), buffered for line iteration."""
    compression = _suffixes(path)[0]
    if compression == ".zst":
        return io.BufferedReader(_ZstdReader(raw, chunk_bytes, _zstandard(path)), chunk_bytes)  # type: ignore[return-value]
    if compression == ".gz":
        return io.BufferedReader(_GzipReader(raw), chunk_bytes)  # type: ignore[return-value]
    return raw


def text_documents(lines: Iterable[str]) -> Iterator[str]:
    """One document per paragraph; paragraphs are separated by empty lines."""
    held: list[str] = []
    for line in lines:
        if line == "\n":
            doc = "".join(held).strip()
            held = []
            if doc:
                yield doc
        else:
            held.append(line)
    doc = "".join(held).strip()
    if doc:
        yield doc


def _jsonl_text(raw: bytes, key: str) -> str:
    """The document of one JSONL line; ValueError says what is wrong with it."""
    try:
        obj = json.loads(raw)
    except UnicodeDecodeError:
        raise ValueError("not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"a JSON {type(obj).__name__}, not an object")
    if key not in obj:
        raise ValueError(f"no {key!r} key")
    if not isinstance(obj[key], str):
        raise ValueError(f"{key!r} is a {type(obj[key]).__name__}, not a string")
    return obj[key]


def jsonl_documents(
    lines: Iterable[bytes],
    path: Path | str,
    json_key: str = "text",
    skip_bad_lines: bool = False,
    stats: ReadStats | None = None,
) -> Iterator[str]:
    """The ``json_key`` text of each line of a JSONL file (``path`` names it in errors)."""
    for lineno, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            text = _jsonl_text(raw, json_key)
        except ValueError as exc:
            if not skip_bad_lines:
                raise DataError(
                    f"{path}:{lineno}: {exc}; fix: make every line a JSON object with a string "
                    f"{json_key!r} field (or --json-key NAME), or pass --skip-bad-lines"
                ) from None
            if stats is not None:
                stats.skipped_lines += 1
            continue
        if text:
            yield text


def parquet_documents(path: Path | str, column_name: str, batch_rows: int = 256) -> Iterator[str]:
    """The non-empty strings of one column of a Parquet file, a row group at a time."""
    import pyarrow  # deferred: pyarrow takes ~0.3 s to import and only Parquet needs it
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as exc:  # a bad or missing footer
        raise DataError(f"{path}: not a readable Parquet file ({exc}); fix: re-copy or re-export the file") from None
    names = pf.schema_arrow.names
    if column_name not in names:
        shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        raise DataError(
            f"{path}: no column {column_name!r} (columns: {shown}); fix: pass --json-key with the text column's name"
        )
    kind = pf.schema_arrow.field(column_name).type
    if not (pyarrow.types.is_string(kind) or pyarrow.types.is_large_string(kind)):
        raise DataError(
            f"{path}: column {column_name!r} holds {kind}, not text; fix: pass --json-key with the text column's name"
        )
    # One row group's column at a time (``iter_batches`` buffers several: 15 MB against 4 MB measured
    # on 1 MB row groups), turned into Python strings ``batch_rows`` at a time.
    for group in range(pf.num_row_groups):
        column = pf.read_row_group(group, columns=[column_name], use_threads=False).column(0)
        for start in range(0, len(column), batch_rows):
            for text in column.slice(start, batch_rows).to_pylist():
                if isinstance(text, str) and text:
                    yield text
        del column


def _file_documents(
    f: BinaryIO, path: Path | str, json_key: str, skip_bad_lines: bool, stats: ReadStats | None
) -> Iterator[str]:
    if is_jsonl(path):
        yield from jsonl_documents(f, path, json_key, skip_bad_lines, stats)
    else:
        yield from text_documents(io.TextIOWrapper(f, encoding="utf-8", errors="replace"))  # type: ignore[arg-type]


def file_documents(
    path: Path | str,
    json_key: str = "text",
    skip_bad_lines: bool = False,
    skip_bad_files: bool = False,
    stats: ReadStats | None = None,
    chunk_bytes: int = READ_CHUNK_BYTES,
) -> Iterator[str]:
    """Every document of one file, by its suffix."""
    if not Path(path).is_file():
        raise DataError(f"{path}: no such input file; fix: pass existing text, JSONL or Parquet files")
    if is_parquet(path):
        yield from parquet_documents(path, json_key)
        return
    kept = 0
    with open(path, "rb") as raw:
        try:
            for doc in _file_documents(open_binary(raw, path, chunk_bytes), path, json_key, skip_bad_lines, stats):
                kept += 1
                yield doc
        except BadCompressedFile as exc:
            if not skip_bad_files:
                raise DataError(
                    f"{path}: {exc.reason} at compressed byte {exc.offset} after {kept} documents; fix: "
                    "re-download or re-compress the file, or pass --skip-bad-files to keep what was read and go on"
                ) from None
            if stats is not None:
                stats.bad_files.append(
                    {"file": str(path), "offset": exc.offset, "reason": exc.reason, "documents_kept": kept}
                )


def read_documents(
    paths: Iterable[Path | str],
    json_key: str = "text",
    skip_bad_lines: bool = False,
    stats: ReadStats | None = None,
    skip_bad_files: bool = False,
    chunk_bytes: int = READ_CHUNK_BYTES,
) -> Iterator[str]:
    """Every document of ``paths`` in order (see the module docstring for formats and errors)."""
    for path in paths:
        yield from file_documents(path, json_key, skip_bad_lines, skip_bad_files, stats, chunk_bytes)


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

"""Documents from input files: plain text (one per blank-line separated paragraph) and JSONL.

Contract: :func:`read_documents` yields document strings from files in order, streaming (a file is
never read whole). A file ending in one of :data:`JSONL_SUFFIXES` is JSONL, Megatron's convention:
one JSON object per line with the text under ``json_key``; blank lines and empty texts are no
documents. Any other file is UTF-8 text (undecodable bytes replaced), split at empty lines, each
paragraph stripped. A JSONL line that is not a JSON object with a string ``json_key`` is a one-line
:class:`DataError` naming ``file:line`` and the fix, unless ``skip_bad_lines``: then it is skipped
and counted in :class:`ReadStats`. :func:`synthetic_documents` is a deterministic English-like
corpus for demos and tests.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pretrain.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")

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


def is_jsonl(path: Path | str) -> bool:
    return Path(path).suffix.lower() in JSONL_SUFFIXES


def text_documents(path: Path | str) -> Iterator[str]:
    """One document per paragraph; paragraphs are separated by empty lines."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines: list[str] = []
        for line in f:
            if line == "\n":
                doc = "".join(lines).strip()
                lines = []
                if doc:
                    yield doc
            else:
                lines.append(line)
        doc = "".join(lines).strip()
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
    path: Path | str, json_key: str = "text", skip_bad_lines: bool = False, stats: ReadStats | None = None
) -> Iterator[str]:
    """The ``json_key`` text of each line of a JSONL file."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
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


def read_documents(
    paths: Iterable[Path | str], json_key: str = "text", skip_bad_lines: bool = False, stats: ReadStats | None = None
) -> Iterator[str]:
    """Every document of ``paths`` in order: JSONL by suffix, text otherwise."""
    for path in paths:
        if not Path(path).is_file():
            raise DataError(f"{path}: no such input file; fix: pass existing text or JSONL files")
        if is_jsonl(path):
            yield from jsonl_documents(path, json_key, skip_bad_lines, stats)
        else:
            yield from text_documents(path)


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

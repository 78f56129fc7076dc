"""``manifest.json``: what a published step contains, with sizes and digests per file.

Format v2 (written now) lists per file its size, hash name, chunk size, one digest per chunk and a
whole-file digest derived from them (:mod:`tiering.digest`). Format v1 (written before 2026-12-01)
lists one SHA-256 per file and stays readable and verifiable. Any other version is refused with
its number named, never passed silently.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from tiering.digest import HASHES, HEX_LENGTH, ChunkedDigest, chunk_count, whole_digest
from tiering.errors import VerificationError

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
MIN_CHUNK_BYTES = 64 * 1024
MANIFEST_NAME = "manifest.json"
COMMITTED_NAME = "COMMITTED"


@dataclass(frozen=True)
class FileEntry:
    """One file of a step: v2 entries carry a chunked digest, v1 entries a whole-file SHA-256."""

    path: str
    bytes: int
    sha256: str = ""  # format v1 only
    hash: str = ""
    chunk_bytes: int = 0
    chunks: tuple[str, ...] = ()
    digest: str = ""  # whole-file digest derived from ``chunks`` (v2)

    @classmethod
    def of(cls, path: str, digest: ChunkedDigest) -> FileEntry:
        return cls(path, digest.size, "", digest.hash, digest.chunk_bytes, digest.chunks, digest.whole)

    @property
    def chunked(self) -> ChunkedDigest | None:
        if not self.hash:
            return None
        return ChunkedDigest(self.hash, self.chunk_bytes, self.bytes, self.chunks)

    @property
    def identity(self) -> str:
        """The file's whole digest, tagged with its hash (object metadata, resumable uploads)."""
        return f"{self.hash}:{self.digest}" if self.hash else f"sha256:{self.sha256}"

    def to_dict(self) -> dict[str, Any]:
        if not self.hash:
            return {"path": self.path, "bytes": self.bytes, "sha256": self.sha256}
        return {
            "path": self.path,
            "bytes": self.bytes,
            "hash": self.hash,
            "chunk_bytes": self.chunk_bytes,
            "chunks": list(self.chunks),
            "digest": self.digest,
        }


@dataclass
class Manifest:
    run_id: str
    step: int
    world_size: int
    parallelism: dict[str, int]
    files: list[FileEntry]
    framework: dict[str, str] = field(default_factory=dict)
    code_version: dict[str, str] = field(default_factory=dict)
    dataset_snapshot: str = ""
    format: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    created_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    schema_version: int = SCHEMA_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def to_json(self) -> bytes:
        body = asdict(self)
        body["files"] = [f.to_dict() for f in sorted(self.files, key=lambda f: f.path)]
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes, where: Path | str) -> Manifest:
        """Parse and schema-check; any defect raises VerificationError naming ``where``."""
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise VerificationError(where, f"manifest is not valid JSON ({exc.__class__.__name__})") from exc
        if not isinstance(body, dict):
            raise VerificationError(where, "manifest is not a JSON object")
        version = body.get("schema_version")
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            raise VerificationError(
                where,
                f"unsupported manifest schema_version {version!r} (this reader knows "
                f"{', '.join(map(str, READABLE_VERSIONS))})",
                "upgrade resilient-pretrain to read it; the step is skipped",
            )
        required = {"run_id": str, "step": int, "world_size": int, "parallelism": dict, "files": list}
        for key, typ in required.items():
            if not isinstance(body.get(key), typ) or isinstance(body.get(key), bool):
                raise VerificationError(where, f"manifest field '{key}' is missing or not a {typ.__name__}")
        parse = _v1_entry if version == 1 else _v2_entry
        files = [parse(item, where) for item in body["files"]]
        if not files:
            raise VerificationError(where, "manifest lists no files")
        known = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in body.items() if k in known}
        kwargs["files"] = files
        return cls(**kwargs)


def _v1_entry(item: object, where: Path | str) -> FileEntry:
    if (
        not isinstance(item, dict)
        or not isinstance(item.get("path"), str)
        or not isinstance(item.get("bytes"), int)
        or not isinstance(item.get("sha256"), str)
    ):
        raise VerificationError(where, f"manifest file entry {item!r} is malformed")
    check_relative_path(item["path"], where)
    return FileEntry(item["path"], item["bytes"], item["sha256"])


def _v2_entry(item: object, where: Path | str) -> FileEntry:
    """A v2 entry, checked for a known hash, digests of that hash's length, and a chunk list that
    adds up to the file size and to the whole-file digest."""
    if not isinstance(item, dict) or not isinstance(item.get("path"), str):
        raise VerificationError(where, f"manifest file entry {item!r} is malformed")
    rel = item["path"]
    check_relative_path(rel, where)
    size, name, chunk_bytes, chunks = item.get("bytes"), item.get("hash"), item.get("chunk_bytes"), item.get("chunks")
    if not isinstance(size, int) or size < 0 or not isinstance(chunk_bytes, int) or not isinstance(chunks, list):
        raise VerificationError(where, f"{rel}: manifest entry lacks bytes/chunk_bytes/chunks")
    if name not in HASHES:
        raise VerificationError(
            where,
            f"{rel}: unknown hash {name!r} (known: {', '.join(sorted(HASHES))})",
            "upgrade resilient-pretrain to read it; the step is skipped",
        )
    if chunk_bytes < MIN_CHUNK_BYTES:
        raise VerificationError(where, f"{rel}: chunk_bytes {chunk_bytes} is below {MIN_CHUNK_BYTES}")
    if len(chunks) != chunk_count(size, chunk_bytes):
        raise VerificationError(
            where,
            f"{rel}: {len(chunks)} chunk digests do not add up to {size} bytes in chunks of {chunk_bytes} "
            f"({chunk_count(size, chunk_bytes)} expected)",
        )
    width = HEX_LENGTH[name]
    for index, hexd in enumerate(chunks):
        if not isinstance(hexd, str) or len(hexd) != width or any(c not in "0123456789abcdef" for c in hexd):
            raise VerificationError(where, f"{rel}: chunk {index} digest is not {width} hex digits of {name}")
    if item.get("digest") != whole_digest(name, size, chunk_bytes, chunks):
        raise VerificationError(where, f"{rel}: whole-file digest does not match its chunk list")
    return FileEntry(rel, size, "", name, chunk_bytes, tuple(chunks), item["digest"])


def check_relative_path(rel: str, where: Path | str) -> None:
    """Reject absolute paths, ``..``, NUL and other control characters, and anything that is not
    a plain relative POSIX path."""
    pure = PurePosixPath(rel)
    if any(ord(c) < 32 or c == "\x7f" for c in rel):
        raise VerificationError(
            where, f"manifest path {rel!r} holds a control character", "the sender's header or manifest is refused"
        )
    if not rel or pure.is_absolute() or "\\" in rel or any(part in ("..", ".", "") for part in rel.split("/")):
        raise VerificationError(
            where,
            f"manifest path {rel!r} escapes the step directory",
            "the manifest is untrusted; the step is skipped and quarantined",
        )

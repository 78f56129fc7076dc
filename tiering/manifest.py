"""``manifest.json``: what a published step contains, with sizes and SHA-256 per file."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from tiering.errors import VerificationError

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
COMMITTED_NAME = "COMMITTED"


@dataclass(frozen=True)
class FileEntry:
    path: str
    bytes: int
    sha256: str


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
        body["files"] = [asdict(f) for f in sorted(self.files, key=lambda f: f.path)]
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
        if body.get("schema_version") != SCHEMA_VERSION:
            raise VerificationError(
                where,
                f"unsupported manifest schema_version {body.get('schema_version')!r}",
                "upgrade resilient-pretrain to read it; the step is skipped",
            )
        required = {"run_id": str, "step": int, "world_size": int, "parallelism": dict, "files": list}
        for key, typ in required.items():
            if not isinstance(body.get(key), typ) or isinstance(body.get(key), bool):
                raise VerificationError(where, f"manifest field '{key}' is missing or not a {typ.__name__}")
        files = []
        for item in body["files"]:
            if (
                not isinstance(item, dict)
                or not isinstance(item.get("path"), str)
                or not isinstance(item.get("bytes"), int)
                or not isinstance(item.get("sha256"), str)
            ):
                raise VerificationError(where, f"manifest file entry {item!r} is malformed")
            check_relative_path(item["path"], where)
            files.append(FileEntry(item["path"], item["bytes"], item["sha256"]))
        if not files:
            raise VerificationError(where, "manifest lists no files")
        known = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in body.items() if k in known}
        kwargs["files"] = files
        return cls(**kwargs)


def check_relative_path(rel: str, where: Path | str) -> None:
    """Reject absolute paths, ``..``, and anything that is not a plain relative POSIX path."""
    pure = PurePosixPath(rel)
    if not rel or pure.is_absolute() or "\\" in rel or any(part in ("..", ".", "") for part in rel.split("/")):
        raise VerificationError(
            where,
            f"manifest path {rel!r} escapes the step directory",
            "the manifest is untrusted; the step is skipped and quarantined",
        )

"""The six corruptions of a v2 step (bytes, and the chunk list of its manifest) and a small step
to apply them to: shared by the tier-1/replica/object-store tests and the transport tests (light
imports: the transport test's spawned ranks import it)."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from pathlib import Path

from tiering.collective import SingleProcess
from tiering.digest import LOCAL_HASH, HashSpec
from tiering.layout import RunLayout
from tiering.local.publish import PosixStepPublisher, manifest_for
from tiering.manifest import MANIFEST_NAME
from tiering.system.fsio import write_file_durably
from tiering.verify import committed_marker

CHUNK = 64 * 1024  # the smallest chunk a manifest accepts: several chunks in a small file
SPEC = HashSpec(LOCAL_HASH, CHUNK, 2)
RUN = "t"
STATE = "state.pt"
SIZE = 5 * CHUNK + 1234  # six chunks, the last one short


# -- the corruptions -------------------------------------------------------------------------------
def _rewrite_manifest(step_dir: Path, edit: Callable[[dict], None]) -> None:
    """Edit a committed manifest and rebind COMMITTED to it, so only the edit itself is wrong."""
    body = json.loads((step_dir / MANIFEST_NAME).read_text())
    edit(body)
    raw = (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()
    (step_dir / MANIFEST_NAME).write_bytes(raw)
    (step_dir / "COMMITTED").write_bytes(committed_marker(body["step"], raw))


def _flip_middle_chunk(step_dir: Path) -> None:
    with open(step_dir / STATE, "r+b") as fh:
        fh.seek(2 * CHUNK + 100)
        byte = fh.read(1)
        fh.seek(2 * CHUNK + 100)
        fh.write(bytes([byte[0] ^ 1]))


def _truncate_last_chunk(step_dir: Path) -> None:
    os.truncate(step_dir / STATE, SIZE - 10)


def _drop_a_chunk(body: dict) -> None:
    body["files"][0]["chunks"].pop()


def _short_digest(body: dict) -> None:
    body["files"][0]["chunks"][1] = body["files"][0]["chunks"][1][:20]


def _unknown_hash(body: dict) -> None:
    body["files"][0]["hash"] = "md4"


def _future_version(body: dict) -> None:
    body["schema_version"] = 3


CORRUPTIONS: dict[str, tuple[Callable[[Path], None], str]] = {
    "chunk flipped in the middle": (_flip_middle_chunk, "chunk 2 of 6"),
    "truncated last chunk": (_truncate_last_chunk, "truncated in chunk 5 of 6"),
    "chunk list does not add up": (lambda d: _rewrite_manifest(d, _drop_a_chunk), "5 chunk digests do not add up"),
    "digest of the wrong length": (lambda d: _rewrite_manifest(d, _short_digest), "chunk 1 digest is not"),
    "unknown hash name": (lambda d: _rewrite_manifest(d, _unknown_hash), "unknown hash 'md4'"),
    "format this reader does not know": (
        lambda d: _rewrite_manifest(d, _future_version),
        "unsupported manifest schema_version 3",
    ),
}


def state_bytes(step: int) -> bytes:
    return random.Random(step).randbytes(SIZE)


def publish_step(layout: RunLayout, step: int, spec: HashSpec = SPEC, owner: int = 0) -> Path:
    pub = PosixStepPublisher(layout, SingleProcess(), f"a{step}", spec)
    tmp = pub.begin(step)
    data = state_bytes(step)
    digest = write_file_durably(tmp / STATE, lambda fh: fh.write(data), spec)
    manifest = manifest_for(RUN, step, 1, {"tp": 1, "pp": 1, "dp": 1}, extra={"owner_rank": owner})
    pub.commit(tmp, manifest, known={STATE: digest})
    return layout.step_dir(step)

"""Moving step files between ranks over torch.distributed with bounded waits.

A step travels as a JSON header (owner, step, run id, the owner's exact ``manifest.json`` bytes,
file names and sizes) and one contiguous byte tensor holding every file. Files are read straight
into that tensor and received into one preallocated tensor, so the bytes are not copied on the
way. The receiver checks each digest chunk as soon as it has arrived (:class:`StreamChecker`,
against the manifest in the header), while the rest is still on the wire: nothing is hashed again
before the replica is committed. Every pair of ranks that may talk exchanges sizes first (0 means
"nothing this time"), so a rank whose save failed never leaves its peer waiting. Every wait has a
timeout: a dead or hung peer costs at most ``timeout_s``, never a hang.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tiering.digest import ChunkedDigest, StreamChecker
from tiering.errors import VerificationError
from tiering.manifest import MANIFEST_NAME, Manifest

CHUNK = 64 * 1024 * 1024


@dataclass
class StepPayload:
    header: dict[str, Any]
    manifest_raw: bytes
    names: list[tuple[str, int]]  # (relative path, size) in data order
    data: torch.Tensor  # uint8, every file back to back
    checked: StreamChecker | None = None  # set on a received payload whose chunks were checked on arrival

    @classmethod
    def from_step_dir(cls, step_dir: Path, header: dict[str, Any]) -> StepPayload:
        raw = (step_dir / MANIFEST_NAME).read_bytes()
        manifest = Manifest.from_json(raw, step_dir / MANIFEST_NAME)
        names = [(f.path, f.bytes) for f in manifest.files]
        data = torch.empty(sum(size for _, size in names), dtype=torch.uint8)
        view = memoryview(data.numpy())
        offset = 0
        for rel, size in names:
            with open(step_dir / rel, "rb", buffering=0) as fh:
                got = 0
                while got < size:
                    n = fh.readinto(view[offset + got : offset + size])
                    if not n:
                        raise OSError(f"{step_dir / rel}: shorter than its manifest entry")
                    got += n
            offset += size
        return cls(header, raw, names, data)

    def files(self) -> list[tuple[str, memoryview]]:
        view = memoryview(self.data.numpy())
        out, offset = [], 0
        for rel, size in self.names:
            out.append((rel, view[offset : offset + size]))
            offset += size
        return out

    def header_bytes(self) -> bytes:
        return json.dumps({**self.header, "manifest": self.manifest_raw.decode("utf-8"), "files": self.names}).encode()

    @classmethod
    def from_wire(cls, header_raw: bytes, data: torch.Tensor) -> StepPayload:
        head = json.loads(header_raw.decode("utf-8"))
        names = [(str(n), int(s)) for n, s in head.pop("files")]
        if sum(s for _, s in names) != data.numel():
            raise ValueError(f"payload has {data.numel()} bytes, its header lists {sum(s for _, s in names)}")
        return cls(head, head.pop("manifest").encode("utf-8"), names, data)


class Transport:
    """Point-to-point step exchange on a (gloo) process group that contains every rank."""

    def __init__(self, group: Any, timeout_s: float) -> None:
        self.group = group
        self.timeout = datetime.timedelta(seconds=timeout_s)

    def exchange(
        self, outgoing: dict[int, StepPayload | None], incoming: list[int]
    ) -> tuple[dict[int, StepPayload], dict[int, str]]:
        """Send a payload (or None: nothing) to each peer in ``outgoing``; receive from each in ``incoming``.

        Returns the payloads received (peers that sent nothing are absent) and one error line per
        peer that failed or timed out.
        """
        errors: dict[int, str] = {}
        sizes = {src: torch.zeros(2, dtype=torch.int64) for src in incoming}
        heads = {dst: p.header_bytes() if p is not None else b"" for dst, p in outgoing.items()}
        works = [(src, dist.irecv(sizes[src], src=src, group=self.group, tag=1)) for src in incoming]
        for dst, payload in outgoing.items():
            size = torch.tensor([len(heads[dst]), payload.data.numel() if payload is not None else 0])
            works.append((dst, dist.isend(size, dst=dst, group=self.group, tag=1)))
        self._wait(works, errors)

        recv_head: dict[int, torch.Tensor] = {}
        recv_data: dict[int, torch.Tensor] = {}
        pieces: dict[int, list[tuple[int, Any]]] = {}  # src -> [(end offset, work)] in data order
        head_works: dict[int, Any] = {}
        for src in incoming:
            head_len, data_len = (int(x) for x in sizes[src].tolist())
            if src in errors or head_len == 0:
                continue
            recv_head[src] = torch.empty(head_len, dtype=torch.uint8)
            recv_data[src] = torch.empty(data_len, dtype=torch.uint8)
            head_works[src] = (recv_head[src], dist.irecv(recv_head[src], src=src, group=self.group, tag=2))
            pieces[src] = [
                (int(chunk.storage_offset()) + chunk.numel(), dist.irecv(chunk, src=src, group=self.group, tag=3 + i))
                for i, chunk in enumerate(_chunks(recv_data[src]))
            ]
        sends = []
        for dst, payload in outgoing.items():
            if payload is None or dst in errors:
                continue
            head = torch.frombuffer(bytearray(heads[dst]), dtype=torch.uint8)
            sends.append((dst, dist.isend(head, dst=dst, group=self.group, tag=2)))
            sends += [
                (dst, dist.isend(chunk, dst=dst, group=self.group, tag=3 + i))
                for i, chunk in enumerate(_chunks(payload.data))
            ]
        checkers = {src: self._receive(src, head_works[src], recv_data[src], pieces[src], errors) for src in recv_head}
        self._wait(sends, errors)

        received = {}
        for src in recv_head:
            if src in errors:
                continue
            try:
                received[src] = StepPayload.from_wire(recv_head[src].numpy().tobytes(), recv_data[src])
                received[src].checked = checkers[src]
            except (ValueError, KeyError, UnicodeDecodeError) as exc:
                errors[src] = f"malformed payload: {exc}"
        return received, errors

    def _receive(
        self,
        src: int,
        head_work: tuple[torch.Tensor, Any],
        data: torch.Tensor,
        pieces: list[tuple[int, Any]],
        errors: dict[int, str],
    ) -> StreamChecker | None:
        """Wait for one peer's header, then its data pieces in order, checking every digest chunk
        that is complete while the next piece arrives."""
        head, work = head_work
        self._wait([(src, work)], errors)
        checker = None if src in errors else _checker_for(head, data)
        for end, work in pieces:
            self._wait([(src, work)], errors)
            if src in errors:
                return None
            if checker is not None:
                checker.arrived(end)
        return checker

    def _wait(self, works: list[tuple[int, Any]], errors: dict[int, str]) -> None:
        for peer, work in works:
            if peer in errors:
                continue
            try:
                if not work.wait(self.timeout):
                    errors[peer] = f"timed out after {self.timeout.total_seconds():.0f}s"
            except Exception as exc:  # gloo raises RuntimeError/DistBackendError when a peer is gone
                errors[peer] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _checker_for(head: torch.Tensor, data: torch.Tensor) -> StreamChecker | None:
    """A checker for a payload whose header lists chunked (v2) digests for exactly its files, in
    data order; otherwise None (the receiver then checks the whole files before committing)."""
    try:
        body = json.loads(head.numpy().tobytes().decode("utf-8"))
        manifest = Manifest.from_json(body["manifest"].encode("utf-8"), "<received manifest>")
        names = [(str(n), int(s)) for n, s in body["files"]]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, VerificationError):
        return None
    listed = {f.path: f.chunked for f in manifest.files}
    files: list[tuple[str, ChunkedDigest]] = []
    for rel, size in names:
        expected = listed.get(rel)
        if expected is None or expected.size != size:
            return None
        files.append((rel, expected))
    if sum(size for _, size in names) != data.numel():
        return None
    return StreamChecker(memoryview(data.numpy()).cast("B"), files)


def _chunks(data: torch.Tensor) -> list[torch.Tensor]:
    return [data.narrow(0, off, min(CHUNK, data.numel() - off)) for off in range(0, data.numel(), CHUNK)]

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
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tiering.digest import ChunkedDigest, StreamChecker
from tiering.errors import VerificationError
from tiering.manifest import MANIFEST_NAME, Manifest, check_relative_path
from tiering.verify import verify_step

CHUNK = 64 * 1024 * 1024


@dataclass
class StepPayload:
    header: dict[str, Any]
    manifest_raw: bytes
    names: list[tuple[str, int]]  # (relative path, size) in data order
    data: torch.Tensor  # uint8, every file back to back
    checked: StreamChecker | None = None  # set on a received payload whose chunks were checked on arrival
    spilled: Path | None = None  # set on a received payload already written there as it arrived

    @classmethod
    def from_step_dir(cls, step_dir: Path, header: dict[str, Any], check: bool = False) -> StepPayload:
        """Read a step's files into one tensor. ``check``: verify the step while reading it (its
        structure first, then every chunk as soon as it is in memory, on two threads), so a copy
        is read and hashed in one pass before it is sent; raises VerificationError."""
        if check:
            verify_step(step_dir, hash_files=False)
        raw = (step_dir / MANIFEST_NAME).read_bytes()
        manifest = Manifest.from_json(raw, step_dir / MANIFEST_NAME)
        names = [(f.path, f.bytes) for f in manifest.files]
        data = torch.empty(sum(size for _, size in names), dtype=torch.uint8)
        view = memoryview(data.numpy()).cast("B")
        chunked = [(f.path, f.chunked) for f in manifest.files]
        checker = None
        if check and all(c is not None for _, c in chunked):
            checker = StreamChecker(view, [(rel, c) for rel, c in chunked if c is not None])
        offset = 0
        for rel, size in names:
            with open(step_dir / rel, "rb", buffering=0) as fh:
                got = 0
                while got < size:
                    n = fh.readinto(view[offset + got : offset + min(size, got + CHUNK)])
                    if not n:
                        raise OSError(f"{step_dir / rel}: shorter than its manifest entry")
                    got += n
                    if checker is not None:
                        checker.arrived(offset + got)
            offset += size
        if checker is not None:
            bad = checker.result()
            if bad is not None:
                raise VerificationError(step_dir / bad[0], bad[1])
        elif check:
            verify_step(step_dir)  # format v1: whole-file SHA-256 (from the page cache now)
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
        self,
        outgoing: dict[int, StepPayload | None],
        incoming: list[int],
        spill_to: dict[int, Path] | None = None,
    ) -> tuple[dict[int, StepPayload], dict[int, str]]:
        """Send a payload (or None: nothing) to each peer in ``outgoing``; receive from each in ``incoming``.

        Returns the payloads received (peers that sent nothing are absent) and one error line per
        peer that failed or timed out. ``spill_to[src]``: also write what ``src`` sends, as it
        arrives, into its files under that (new) directory, so that writing overlaps receiving
        (the payload's ``spilled`` names it; nothing there is published or trusted yet).
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
        spills = {src: _Spill(spill_to[src]) if spill_to and src in spill_to else None for src in recv_head}
        checkers = {
            src: self._receive(src, head_works[src], recv_data[src], pieces[src], errors, spills[src])
            for src in recv_head
        }
        self._wait(sends, errors)

        received = {}
        for src in recv_head:
            if src in errors:
                continue
            try:
                received[src] = StepPayload.from_wire(recv_head[src].numpy().tobytes(), recv_data[src])
                received[src].checked = checkers[src]
                spill = spills[src]
                received[src].spilled = spill.root if spill is not None and spill.complete else None
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
        spill: _Spill | None,
    ) -> StreamChecker | None:
        """Wait for one peer's header, then its data pieces in order, checking every digest chunk
        and writing (``spill``) every piece that is complete while the next piece arrives."""
        head, work = head_work
        self._wait([(src, work)], errors)
        checker = None if src in errors else _checker_for(head, data)
        view = memoryview(data.numpy()).cast("B")
        try:
            if spill is not None and src not in errors:
                spill.open(head)
            for end, work in pieces:
                self._wait([(src, work)], errors)
                if src in errors:
                    return None
                if checker is not None:
                    checker.arrived(end)
                if spill is not None:
                    spill.write(view, end)
        except (OSError, ValueError, KeyError, VerificationError) as exc:
            errors[src] = f"writing the received copy failed: {exc}"
        finally:
            if spill is not None:
                spill.close()
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


class _Spill:
    """Writes a received payload into its files under ``root`` as the pieces arrive."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._files: list[tuple[int, int, int]] = []  # (start offset, size, fd)
        self._done = 0
        self._total = -1
        self.complete = False

    def open(self, head: torch.Tensor) -> None:
        body = json.loads(head.numpy().tobytes().decode("utf-8"))
        offset = 0
        for rel, size in ((str(n), int(s)) for n, s in body["files"]):
            check_relative_path(rel, self.root)
            path = self.root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            self._files.append((offset, size, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)))
            offset += size
        self._total = offset

    def write(self, view: memoryview, upto: int) -> None:
        for start, size, fd in self._files:
            lo, hi = max(start, self._done), min(start + size, upto)
            if lo < hi:
                os.pwrite(fd, view[lo:hi], lo - start)
        self._done = upto
        self.complete = upto >= self._total

    def close(self) -> None:
        for _, _, fd in self._files:
            os.close(fd)
        self._files = []


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

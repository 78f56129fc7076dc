"""Moving step files between ranks over torch.distributed with bounded waits.

A step travels as one blob: an 8-byte header length, a JSON header (owner, step, run id, the
owner's exact ``manifest.json`` bytes, file names and sizes) and the file bytes. Every pair of
ranks that may talk exchanges a length first (0 means "nothing this time"), so a rank whose save
failed never leaves its peer waiting. Every wait has a timeout: a dead or hung peer costs at most
``timeout_s``, never a hang.
"""

from __future__ import annotations

import datetime
import json
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

CHUNK = 64 * 1024 * 1024


@dataclass
class StepPayload:
    header: dict[str, Any]
    manifest_raw: bytes
    files: list[tuple[str, bytes]] = field(default_factory=list)

    def encode(self) -> bytes:
        head = {
            **self.header,
            "manifest": self.manifest_raw.decode("utf-8"),
            "files": [[name, len(data)] for name, data in self.files],
        }
        head_raw = json.dumps(head).encode()
        return b"".join([struct.pack("<Q", len(head_raw)), head_raw, *(data for _, data in self.files)])

    @classmethod
    def decode(cls, blob: bytes) -> StepPayload:
        (head_len,) = struct.unpack("<Q", blob[:8])
        head = json.loads(blob[8 : 8 + head_len].decode("utf-8"))
        offset = 8 + head_len
        files = []
        for name, size in head.pop("files"):
            files.append((name, blob[offset : offset + size]))
            offset += size
        if offset != len(blob):
            raise ValueError(f"payload length {len(blob)} does not match its header ({offset})")
        manifest_raw = head.pop("manifest").encode("utf-8")
        return cls(head, manifest_raw, files)


class TransferError(RuntimeError):
    pass


class Transport:
    """Point-to-point blob exchange on a (gloo) process group that contains every rank."""

    def __init__(self, group: Any, timeout_s: float) -> None:
        self.group = group
        self.timeout = datetime.timedelta(seconds=timeout_s)

    def exchange(
        self, outgoing: dict[int, bytes | None], incoming: list[int]
    ) -> tuple[dict[int, bytes], dict[int, str]]:
        """Send a blob (or None: nothing) to each peer in ``outgoing``; receive from each in ``incoming``.

        Returns the blobs received (peers that sent nothing are absent) and one error line per
        peer that failed or timed out.
        """
        import torch.distributed as dist

        errors: dict[int, str] = {}
        lengths = {src: torch.zeros(1, dtype=torch.int64) for src in incoming}
        works = [(src, dist.irecv(lengths[src], src=src, group=self.group, tag=1)) for src in incoming]
        works += [
            (
                dst,
                dist.isend(
                    torch.tensor([len(blob) if blob else 0], dtype=torch.int64), dst=dst, group=self.group, tag=1
                ),
            )
            for dst, blob in outgoing.items()
        ]
        self._wait(works, errors)
        buffers: dict[int, list[torch.Tensor]] = {}
        works = []
        for src in incoming:
            size = int(lengths[src].item())
            if src in errors or size == 0:
                continue
            buffers[src] = [torch.empty(min(CHUNK, size - off), dtype=torch.uint8) for off in range(0, size, CHUNK)]
            works += [
                (src, dist.irecv(buf, src=src, group=self.group, tag=2 + i)) for i, buf in enumerate(buffers[src])
            ]
        for dst, blob in outgoing.items():
            if not blob or dst in errors:
                continue
            view = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            works += [
                (dst, dist.isend(view[off : off + CHUNK], dst=dst, group=self.group, tag=2 + i))
                for i, off in enumerate(range(0, len(blob), CHUNK))
            ]
        self._wait(works, errors)
        received = {src: b"".join(bytes(b.numpy()) for b in bufs) for src, bufs in buffers.items() if src not in errors}
        return received, errors

    def _wait(self, works: list[tuple[int, Any]], errors: dict[int, str]) -> None:
        for peer, work in works:
            if peer in errors:
                continue
            try:
                if not work.wait(self.timeout):
                    errors[peer] = f"timed out after {self.timeout.total_seconds():.0f}s"
            except Exception as exc:  # gloo raises RuntimeError/DistBackendError when a peer is gone
                errors[peer] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

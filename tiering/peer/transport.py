"""Moving step files between ranks over torch.distributed: streamed, checked on both ends, bounded.

A step travels as a JSON header (owner, step, run id, the owner's exact ``manifest.json`` bytes,
file names, sizes and piece sizes), then its files in pieces of whole digest chunks (~64 MiB), then
a trailer word from the sender (-1, or the file it could not read as its manifest lists it).

* The sender reads a piece into one of ``SEND_SLOTS`` reused buffers and hands it to the wire, then
  reads the next while it travels: the disk and the network work at once, and its memory is a few
  pieces whatever the step's size. With ``check`` it verifies every chunk as it is read (one pass),
  so that a bad copy is named by the rank that holds it.
* The receiver, on a thread of its own, takes each piece into one of a few reused buffers, checks
  its chunks there against the manifest in the header while writing it into its file (``pwrite``
  into a file whose space was reserved up front, so a full disk fails before any byte arrives),
  and reposts the buffer for a later piece. Nothing is read back or hashed again before the copy is
  committed; nothing received is published or trusted here (:func:`tiering.local.publish.publish_received`).

Every pair of ranks that may talk exchanges header sizes first (0 means "nothing this time"), so a
rank whose save failed never leaves its peer waiting, and a receiver that cannot write still drains
what it is sent. Every wait has a timeout: a dead or hung peer costs at most ``timeout_s``.

Nothing a peer sends is trusted before it is checked (:mod:`tiering.trust.run_key` is the contract):

* Every header carries an HMAC-SHA256 tag under the run key's ``"transport"`` channel over the
  destination rank, a fresh nonce and the header bytes; the header holds the owner's manifest, hence every chunk
  digest, so the pieces are checked against digests only a holder of the key could have sent. A
  header that does not verify is dropped with one error line; nothing is allocated for it or
  written.
* Before anything is allocated: the header length (``MAX_HEADER``), the file count
  (``MAX_FILES``), the piece count (``MAX_PIECES``), every size and piece size, and every name
  (no NUL or control character, no ``..``, no absolute path) are bounded and checked.
* The receiver answers each header with an accept word, ``TAG_BYTES`` bytes: the run key's tag
  of the header's own tag (which covers a fresh nonce), or zeros for a refusal. A sender streams
  only to a receiver whose word verifies, so a receiver without the key (a rogue that connected to
  pull a replica) gets the header and nothing of the step, and a refused header leaves the pair
  clean for the next exchange. What goes wrong is kept per direction: refusing a peer's header
  never stops this rank from taking that peer's word on its own header (a mutual refusal leaves
  no message unmatched on the pair).
* A whole transfer has a deadline (``timeout_s`` plus its declared bytes at ``MIN_RATE``); the
  receive thread is joined with a timeout, and a receive past it is abandoned (its files removed
  by the thread when it ends): a slow or silent peer costs an error line, not the rank.
"""

from __future__ import annotations

import datetime
import hmac
import json
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tiering.digest import ChunkChecker, ChunkedDigest, ChunkFailure
from tiering.errors import VerificationError
from tiering.local.publish import ReceivedStep
from tiering.manifest import MANIFEST_NAME, Manifest, check_relative_path
from tiering.trust.run_key import TAG_BYTES, RunKey
from tiering.verify import verify_step

log = logging.getLogger(__name__)

PIECE = 64 * 1024 * 1024  # bytes per message, rounded to whole digest chunks
MAX_PIECE = 1024 * 1024 * 1024  # what a receiver accepts from a header (buffers are this size)
SEND_SLOTS = 3  # pieces a sender (and each receiver) has in memory: one being read, two on the wire
TAG_SIZE, TAG_HEAD, TAG_ACK, TAG_DATA = 1, 2, 4, 8
MAX_HEADER = 16 * 1024 * 1024  # bytes of one header (tag included) a receiver accepts
MAX_FILES = 10_000  # files in one transfer
MAX_PIECES = 100_000  # pieces in one transfer (64 MiB pieces: 6 TiB)
MIN_RATE = 50 * 1024 * 1024  # bytes/s a transfer's deadline allows for its declared bytes
CHANNEL = "transport"  # the run key's channel for headers
NONCE_BYTES = 16  # fresh per header: an accept word captured once never answers another header
REFUSED = bytes(TAG_BYTES)  # the accept word of a refusal

# (file index, start in the file, length): the unit of the wire, in order
Piece = tuple[int, int, int]


def piece_bytes(chunk_bytes: int, piece: int = PIECE) -> int:
    """Whole chunks per piece (``chunk_bytes`` 0: no chunks), so that the sender can check a
    piece from its own buffer."""
    return chunk_bytes * max(1, piece // chunk_bytes) if chunk_bytes else piece


def plan_pieces(files: list[tuple[str, int, int]]) -> list[Piece]:
    """Every piece of ``(path, size, piece bytes)`` files, in wire order (sender and receiver alike)."""
    return [
        (i, start, min(step, size - start)) for i, (_, size, step) in enumerate(files) for start in range(0, size, step)
    ]


@dataclass
class OutgoingStep:
    """A published step to send; read piece by piece while it is sent. ``failure`` is set by the
    send when a file could not be read as its manifest lists it (short, unreadable, or a chunk
    that does not match): the copy here is bad, quarantine it. The receiver is told too."""

    step_dir: Path
    header: dict[str, Any]
    manifest_raw: bytes
    names: list[tuple[str, int]]  # (relative path, size) in wire order
    chunk_bytes: list[int]  # per file (0: format v1, no chunks)
    expected: list[ChunkedDigest | None]  # per file: chunks to check while reading (None: not checked)
    failure: str | None = None
    failed_file: int = -1  # index of the file ``failure`` names

    def fail(self, index: int, reason: str) -> None:
        if self.failure is None:
            self.failure, self.failed_file = f"{self.step_dir / self.names[index][0]}: {reason}", index

    @classmethod
    def of(cls, step_dir: Path, header: dict[str, Any], check: bool = False) -> OutgoingStep:
        """``check``: verify the step's structure now and every chunk while it is read for sending
        (format v1 files, which have no chunk list, are verified whole now); raises VerificationError."""
        if check:
            verify_step(step_dir, hash_files=False)
        raw = (step_dir / MANIFEST_NAME).read_bytes()
        manifest = Manifest.from_json(raw, step_dir / MANIFEST_NAME)
        if check and any(f.chunked is None for f in manifest.files):
            verify_step(step_dir)
        names = [(f.path, f.bytes) for f in manifest.files]
        expected = [f.chunked if check else None for f in manifest.files]
        return cls(step_dir, header, raw, names, [f.chunk_bytes for f in manifest.files], expected)

    def wire_files(self, piece: int) -> list[tuple[str, int, int]]:
        """``(relative path, size, piece bytes)`` per file, as the header lists them."""
        sizes = zip(self.names, self.chunk_bytes, strict=True)
        return [(rel, size, piece_bytes(chunk, piece)) for (rel, size), chunk in sizes]

    def header_bytes(self, piece: int) -> bytes:
        body = {**self.header, "manifest": self.manifest_raw.decode("utf-8"), "files": self.wire_files(piece)}
        return json.dumps(body).encode()


class _Incoming:
    """One peer's step being received on its own thread: each piece lands in one of a few reused
    buffers, its chunks are checked there while it is written into its file (``pwrite``: the
    page cache is filled by the kernel, not by page faults), and the buffer takes the next piece.

    A receiver that cannot create its files (a full disk) still receives every piece, writing
    nothing, so that its sender is drained and never waits for a timeout."""

    def __init__(
        self,
        src: int,
        head: dict[str, Any],
        directory: Path,
        expected: list[ChunkedDigest | None],
        slots: list[torch.Tensor],
        deadline: float,
    ) -> None:
        self.src = src
        self.head = head
        self.directory = directory
        self.files: list[tuple[str, int, int]] = head["files"]
        self.expected = expected
        self.error: str | None = None  # why this copy is not kept (set before finish)
        self._slots = slots
        self._fds: list[int] = []
        self._checker = ChunkChecker()
        self._mismatch: ChunkFailure | None = None
        self._thread: threading.Thread | None = None
        self.deadline = deadline  # time.monotonic() by which every piece must have arrived
        self._lock = threading.Lock()
        self._abandoned = False  # finish gave up waiting: the thread cleans up when it ends

    def open(self) -> None:
        """Create the files with their space reserved (``posix_fallocate``: a full disk fails
        here, before any byte arrives); on failure the error is kept and the copy only drained."""
        try:
            if self.directory.exists():
                shutil.rmtree(self.directory)  # a leftover of an interrupted receive under this name
            self.directory.mkdir(parents=True)
            for rel, size, _ in self.files:
                check_relative_path(rel, self.directory)
                path = self.directory / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                self._fds.append(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
                if size:
                    os.posix_fallocate(self._fds[-1], 0, size)
        except (OSError, VerificationError) as exc:
            self.error = f"writing the received copy failed: {exc}"

    def start(self, group: Any, timeout: datetime.timedelta) -> None:
        self._thread = threading.Thread(
            target=self._run, args=(group, timeout), name=f"receive-from-{self.src}", daemon=True
        )
        self._thread.start()

    def _run(self, group: Any, timeout: datetime.timedelta) -> None:
        pieces = plan_pieces(self.files)
        n = len(self._slots)
        works: dict[int, Any] = {}
        try:
            for i in range(min(n, len(pieces))):
                works[i] = self._post(group, pieces[i], i)
            for i, (index, start, length) in enumerate(pieces):
                if time.monotonic() > self.deadline:
                    raise TimeoutError(f"the transfer passed its deadline after {i} of {len(pieces)} pieces")
                if not works.pop(i).wait(timeout):
                    raise TimeoutError(_timed_out(timeout))
                view = memoryview(self._slots[i % n][:length].numpy())
                self._land(index, start, view)
                if i + n < len(pieces):
                    works[i + n] = self._post(group, pieces[i + n], i + n)
            word = torch.zeros(1, dtype=torch.int64)
            if not dist.irecv(word, src=self.src, group=group, tag=TAG_DATA + len(pieces)).wait(timeout):
                raise TimeoutError(_timed_out(timeout))
            if (bad := int(word.item())) >= 0 and self._mismatch is None:
                # The sender could not read that file as listed: whatever arrived for it is not the copy.
                name = self.files[bad][0] if bad < len(self.files) else "?"
                self._mismatch = (name, "the sender could not read it as its manifest lists it (damaged there)")
        except Exception as exc:  # gloo raises RuntimeError/DistBackendError when a peer is gone
            self.error = _one_line(exc, timeout)
        finally:
            with self._lock:
                if self._abandoned:
                    self._release()

    def _release(self) -> None:
        """Close the files and remove the copy (the receive failed or was abandoned)."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        shutil.rmtree(self.directory, ignore_errors=True)

    def _post(self, group: Any, piece: Piece, number: int) -> Any:
        into = self._slots[number % len(self._slots)][: piece[2]]
        return dist.irecv(into, src=self.src, group=group, tag=TAG_DATA + number)

    def _land(self, index: int, start: int, view: memoryview) -> None:
        """Check the piece's chunks and write it at its offset; its buffer is free on return."""
        expected = self.expected[index] if self.error is None else None
        checks = self._checker.check_span(self.files[index][0], expected, start, view) if expected else []
        if self.error is None:
            try:
                with self._lock:
                    if self._abandoned:
                        raise TimeoutError("abandoned")
                    _write_at(self._fds[index], view, start)
            except OSError as exc:
                self.error = f"writing the received copy failed: {exc}"
        for fut in checks:
            if (bad := fut.result()) is not None and self._mismatch is None:
                self._mismatch = bad

    def finish(self, errors: dict[int, str], timeout: datetime.timedelta) -> ReceivedStep | None:
        """Wait for the receive until its deadline (and one more wait); the step, or None (the
        reason in ``errors``, nothing left on disk; a receive still running is abandoned: its
        thread removes the copy when its wait ends)."""
        if self._thread is not None:
            self._thread.join(max(0.0, self.deadline - time.monotonic()) + timeout.total_seconds())
            with self._lock:
                if self._thread.is_alive():
                    self._abandoned = True
                    errors.setdefault(self.src, "the transfer passed its deadline; abandoned")
                    log.error("transport: receive from rank %d abandoned past its deadline", self.src)
                    return None
        self._checker.result()
        if self.src in errors or self.error is not None:
            errors.setdefault(self.src, self.error or "")
            self._release()
            return None
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        checked = frozenset(rel for (rel, _, _), exp in zip(self.files, self.expected, strict=True) if exp is not None)
        names = [(rel, size) for rel, size, _ in self.files]
        manifest_raw = str(self.head.get("manifest", "")).encode("utf-8")
        header = {k: v for k, v in self.head.items() if k not in ("manifest", "files")}
        return ReceivedStep(header, manifest_raw, self.directory, names, checked, self._mismatch)


class Transport:
    """Point-to-point step exchange on a (gloo) process group that contains every rank."""

    def __init__(self, group: Any, timeout_s: float, piece: int = PIECE, *, key: RunKey) -> None:
        self.group = group
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._key = key.for_channel(CHANNEL)
        self._rank = dist.get_rank() if group is not None else 0
        self.piece = piece  # bytes per message (the sender's choice travels in the header)
        # Piece buffers, kept from one exchange to the next (allocated and faulted in once):
        # one set to send from, one per peer received from at once.
        self._buffers: dict[str, list[torch.Tensor]] = {}

    def exchange(
        self,
        outgoing: dict[int, OutgoingStep | None],
        incoming: dict[int, Path],
        before_open: Callable[[int], None] | None = None,
    ) -> tuple[dict[int, ReceivedStep], dict[int, str]]:
        """Send a step (or None: nothing) to each peer in ``outgoing``; receive from each peer in
        ``incoming`` into the (new) directory named for it.

        Returns the steps received (peers that sent nothing are absent) and one error line per peer
        that failed, timed out, or whose copy could not be written here. A payload that could not
        be read as its manifest lists it has its ``failure`` set (it was sent anyway and its
        receiver told, so that nobody waits for a timeout). ``before_open(src)`` runs before the
        directory for a peer that does send something is created (tier 0 unseals the slot it
        receives into only then: a peer that sends nothing costs no copy).
        """
        tx: dict[int, str] = {}  # what went wrong sending to a peer
        rx: dict[int, str] = {}  # what went wrong receiving from a peer
        blobs = {dst: self._tagged_header(p, dst) if p is not None else b"" for dst, p in outgoing.items()}
        heads, tags, refused = self._exchange_headers(blobs, list(incoming), tx, rx)
        self._exchange_acks(blobs, tags, refused, list(incoming), tx, rx)
        receiving = []
        for n, (src, head) in enumerate(heads.items()):
            slots = self._slots(f"receive-{n}", max((min(size, p) for _, size, p in head["files"]), default=0))
            rx_step = _Incoming(src, head, incoming[src], _expected_digests(head), slots, _deadline(head, self.timeout))
            if before_open is not None:
                before_open(src)
            rx_step.open()
            rx_step.start(self.group, self.timeout)
            receiving.append(rx_step)
        accepted = {dst: p for dst, p in outgoing.items() if blobs[dst]}
        for payload, dsts in _group_by_payload(accepted, tx):
            self._stream(payload, dsts, tx)
        received = {r.src: step for r in receiving if (step := r.finish(rx, self.timeout)) is not None}
        return received, _merged(rx, tx)

    def _exchange_headers(
        self, blobs: dict[int, bytes], incoming: list[int], tx: dict[int, str], rx: dict[int, str]
    ) -> tuple[dict[int, dict[str, Any]], dict[int, bytes], set[int]]:
        """Header sizes, then tagged headers: what each peer will send (absent: nothing), with each
        accepted header's tag (its accept word is made from it). A size out of bounds is refused
        before anything is allocated; a header whose tag does not verify, or that is malformed or
        out of bounds, is refused before it is parsed further (one error line). This rank's own
        headers go out whatever it refused of its peers'."""
        sizes = {src: torch.zeros(1, dtype=torch.int64) for src in incoming}
        works = [(src, dist.irecv(sizes[src], src=src, group=self.group, tag=TAG_SIZE)) for src in incoming]
        for dst, blob in blobs.items():
            works.append((dst, dist.isend(torch.tensor([len(blob)]), dst=dst, group=self.group, tag=TAG_SIZE)))
        self._wait_split(works, len(incoming), rx, tx)
        recv: dict[int, torch.Tensor] = {}
        for src in incoming:
            n = int(sizes[src].item()) if src not in rx else 0
            if not 0 <= n <= MAX_HEADER:
                rx[src] = f"refused a header of {n} bytes from rank {src} (0 to {MAX_HEADER >> 20} MiB)"
                log.error("transport: %s", rx[src])
            elif n:
                recv[src] = torch.empty(n, dtype=torch.uint8)
        works = [(src, dist.irecv(t, src=src, group=self.group, tag=TAG_HEAD)) for src, t in recv.items()]
        for dst, blob in blobs.items():
            if blob and dst not in tx:
                tensor = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
                works.append((dst, dist.isend(tensor, dst=dst, group=self.group, tag=TAG_HEAD)))
        self._wait_split(works, len(recv), rx, tx)
        heads: dict[int, dict[str, Any]] = {}
        tags: dict[int, bytes] = {}
        refused = {src for src in incoming if src in rx and src not in recv and int(sizes[src].item()) != 0}
        for src, tensor in recv.items():
            if src in rx:
                continue
            try:
                blob = tensor.numpy().tobytes()
                heads[src], tags[src] = self._verified_header(blob), blob[:TAG_BYTES]
            except (ValueError, KeyError, TypeError, UnicodeDecodeError, VerificationError) as exc:
                rx[src] = f"refused the header of rank {src}: {exc}"  # nothing is posted for it
                log.error("transport: %s", rx[src])
                refused.add(src)
        return heads, tags, refused

    def _exchange_acks(
        self,
        blobs: dict[int, bytes],
        tags: dict[int, bytes],
        refused: set[int],
        incoming: list[int],
        tx: dict[int, str],
        rx: dict[int, str],
    ) -> None:
        """Each receiver answers each sender's header with its accept word (the key's tag of the
        header's tag) or zeros (refused); a sender streams only to those whose word verifies. Every
        word a peer sends is received, whatever this rank thought of that peer's own header."""
        words = {
            dst: torch.zeros(TAG_BYTES, dtype=torch.uint8) for dst, blob in blobs.items() if blob and dst not in tx
        }
        works = [(dst, dist.irecv(w, src=dst, group=self.group, tag=TAG_ACK)) for dst, w in words.items()]
        told = [src for src in incoming if src in tags or src in refused]
        for src in told:
            word = torch.frombuffer(
                bytearray(self._accept_word(tags[src]) if src in tags else REFUSED), dtype=torch.uint8
            )
            works.append((src, dist.isend(word, dst=src, group=self.group, tag=TAG_ACK)))
        late: dict[int, str] = {}
        self._wait_split(works, len(words), tx, late)
        for peer, line in late.items():
            rx.setdefault(peer, line)
        for dst, word in words.items():
            if dst in tx:
                continue
            got = word.numpy().tobytes()
            if got == REFUSED:
                tx[dst] = f"rank {dst} refused the header sent to it (run key or bounds; see its log)"
            elif not hmac.compare_digest(self._accept_word(blobs[dst][:TAG_BYTES]), got):
                tx[dst] = (
                    f"rank {dst} did not prove it holds the run key (its accept word does not verify); nothing sent"
                )
                log.error("transport: %s", tx[dst])

    def _accept_word(self, header_tag: bytes) -> bytes:
        """What a receiver holding the run key answers to a header it accepted: the key's tag of
        the header's own tag (fresh per header: it covers the nonce)."""
        return self._key.tag(b"accept\0" + header_tag)

    def _wait_split(
        self, works: list[tuple[int, Any]], n_first: int, first: dict[int, str], rest: dict[int, str]
    ) -> None:
        """Wait for ``works``: the first ``n_first`` report into ``first``, the others into ``rest``."""
        self._wait(works[:n_first], first)
        self._wait(works[n_first:], rest)

    def _tagged_header(self, payload: OutgoingStep, dst: int) -> bytes:
        """The header for ``dst``: its tag, a fresh nonce, the header; b"" (nothing sent, the
        payload failed) when it is over the bounds a receiver accepts."""
        body = payload.header_bytes(self.piece)
        try:
            _checked_files(json.loads(body)["files"])
            if TAG_BYTES + NONCE_BYTES + len(body) > MAX_HEADER:
                raise ValueError(f"{len(body)} bytes of header, over {MAX_HEADER >> 20} MiB")
        except (ValueError, VerificationError) as exc:
            log.error("transport: %s: not sent to rank %d: %s", payload.step_dir, dst, exc)
            payload.failure = payload.failure or f"{payload.step_dir}: not sent: {exc}"
            return b""
        nonced = secrets.token_bytes(NONCE_BYTES) + body
        return self._key.tag(_bound_to(dst, nonced)) + nonced

    def _verified_header(self, blob: bytes) -> dict[str, Any]:
        """The header in ``blob`` if its tag verifies for this rank and it is within bounds."""
        tag, nonced = blob[:TAG_BYTES], blob[TAG_BYTES:]
        if (
            len(tag) < TAG_BYTES
            or len(nonced) < NONCE_BYTES
            or not self._key.verify(_bound_to(self._rank, nonced), tag)
        ):
            raise ValueError("its run-key tag does not verify (a sender without this run's key, or altered)")
        head = json.loads(nonced[NONCE_BYTES:].decode("utf-8"))
        if not isinstance(head, dict) or not isinstance(head.get("files"), list):
            raise ValueError("not a header object with a file list")
        head["files"] = _checked_files(head["files"])
        return head

    def _stream(self, payload: OutgoingStep, dsts: list[int], errors: dict[int, str]) -> None:
        """Read, check and send ``payload`` piece by piece to ``dsts``, keeping ``SEND_SLOTS``
        pieces in flight, then the trailer word (-1, or the file that could not be read)."""
        files = payload.wire_files(self.piece)
        slots = self._slots("send", max((min(size, p) for _, size, p in files), default=0))
        checker = ChunkChecker()
        inflight: list[tuple[list[tuple[int, Any]], list[Future[ChunkFailure | None]]]] = [([], [])] * SEND_SLOTS
        fds = [_open_or_fail(payload, i) for i in range(len(payload.names))]
        deadline = _deadline({"files": files}, self.timeout)
        try:
            for n, (tag, (index, start, length)) in enumerate(_tagged(plan_pieces(files))):
                if time.monotonic() > deadline:  # a receiver that takes pieces too slowly: give up on it
                    for dst in dsts:
                        errors.setdefault(dst, f"the transfer passed its deadline after {n} pieces")
                if all(dst in errors for dst in dsts):
                    break  # nobody left to send to
                slot = n % SEND_SLOTS
                works, checks = inflight[slot]
                self._wait(works, errors)  # the buffer is free once it is on the wire and checked
                for fut in checks:
                    fut.result()
                buf = slots[slot][:length]
                view = memoryview(buf.numpy())
                if _read_into(fds[index], view, start) < length:
                    # sent anyway (the trailer tells the receiver), so that no receiver waits for a timeout
                    payload.fail(index, "shorter than its manifest entry")
                expected = payload.expected[index]
                checks = checker.check_span(files[index][0], expected, start, view) if expected else []
                works = [
                    (dst, dist.isend(buf, dst=dst, group=self.group, tag=tag)) for dst in dsts if dst not in errors
                ]
                inflight[slot] = (works, checks)
            for works, _ in inflight:
                self._wait(works, errors)
        finally:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
            bad = checker.result()
        if bad is not None:
            payload.fail([rel for rel, _ in payload.names].index(bad[0]), f"{bad[1]}; the copy is quarantined")
        word = torch.tensor([payload.failed_file], dtype=torch.int64)
        tag = TAG_DATA + len(plan_pieces(files))
        self._wait(
            [(dst, dist.isend(word, dst=dst, group=self.group, tag=tag)) for dst in dsts if dst not in errors], errors
        )

    def _slots(self, key: str, size: int) -> list[torch.Tensor]:
        have = self._buffers.get(key)
        if have is None or have[0].numel() < size:
            have = self._buffers[key] = [torch.empty(max(size, 1), dtype=torch.uint8) for _ in range(SEND_SLOTS)]
        return have

    def _wait(self, works: list[tuple[int, Any]], errors: dict[int, str]) -> None:
        """Wait for each work within the timeout; a peer that fails or times out gets its error."""
        for peer, work in works:
            if peer in errors:
                continue
            try:
                if not work.wait(self.timeout):
                    errors[peer] = _timed_out(self.timeout)
            except Exception as exc:  # gloo raises RuntimeError/DistBackendError when a peer is gone
                errors[peer] = _one_line(exc, self.timeout)


def _merged(rx: dict[int, str], tx: dict[int, str]) -> dict[int, str]:
    """One error line per peer: what went wrong receiving from it, then sending to it."""
    return {peer: "; ".join(line for line in (rx.get(peer), tx.get(peer)) if line) for peer in {**rx, **tx}}


def _group_by_payload(
    outgoing: dict[int, OutgoingStep | None], errors: dict[int, str]
) -> Iterator[tuple[OutgoingStep, list[int]]]:
    """Each distinct payload once, with every peer it goes to (a step replicated to two holders is
    read from disk once)."""
    groups: dict[int, tuple[OutgoingStep, list[int]]] = {}
    for dst, payload in outgoing.items():
        if payload is not None and dst not in errors:
            groups.setdefault(id(payload), (payload, []))[1].append(dst)
    yield from groups.values()


def _tagged(pieces: list[Piece]) -> Iterator[tuple[int, Piece]]:
    return enumerate(pieces, start=TAG_DATA)


def _one_line(exc: BaseException, timeout: datetime.timedelta) -> str:
    """A failed wait as one line; gloo's timeouts (its own, or the pair it closed because another
    wait on it timed out) are said to be timeouts first."""
    if isinstance(exc, TimeoutError):
        return str(exc)  # a wait of ours that ran out: already said as one
    first = str(exc).splitlines()[0] if str(exc) else ""
    if "timeout" in first.lower() or "timed out" in first.lower():
        return f"{_timed_out(timeout)} ({type(exc).__name__}: {first})"
    return f"{type(exc).__name__}: {first}"


def _timed_out(timeout: datetime.timedelta) -> str:
    return f"timed out after {timeout.total_seconds():.0f}s"


def _write_at(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], offset + done)


def _open_or_fail(payload: OutgoingStep, index: int) -> int:
    """A file to send, or -1 with the payload's failure set (its pieces still go out, unread)."""
    try:
        return os.open(payload.step_dir / payload.names[index][0], os.O_RDONLY)
    except OSError as exc:
        payload.fail(index, exc.strerror or str(exc))
        return -1


def _read_into(fd: int, view: memoryview, offset: int) -> int:
    got = 0
    while fd >= 0 and got < view.nbytes:
        try:
            n = os.preadv(fd, [view[got:]], offset + got)
        except OSError:
            break  # an I/O error reads as a short file: the payload fails, the protocol goes on
        if n == 0:
            break
        got += n
    return got


def _expected_digests(head: dict[str, Any]) -> list[ChunkedDigest | None]:
    """Per file of a header, the chunk list its manifest gives for exactly that file and size;
    None where there is none (format v1, or a manifest that does not parse: rejected at publish)."""
    files = head["files"]
    try:
        manifest = Manifest.from_json(str(head["manifest"]).encode("utf-8"), "<received manifest>")
    except (KeyError, VerificationError):
        return [None] * len(files)
    listed = {f.path: f.chunked for f in manifest.files}
    out: list[ChunkedDigest | None] = []
    for rel, size, _ in files:
        expected = listed.get(rel)
        out.append(expected if expected is not None and expected.size == size else None)
    return out


def _bound_to(dst: int, body: bytes) -> bytes:
    """What a header's tag covers: the destination rank, then the nonce and the header (a header
    tagged for one rank does not verify on another)."""
    return f"to:{dst}\n".encode() + body


def _checked_files(files: list[Any]) -> list[tuple[str, int, int]]:
    """``(name, size, piece size)`` per file of a header, every bound checked before anything is
    planned or allocated (ValueError/VerificationError: one line naming what is out of bounds)."""
    if len(files) > MAX_FILES:
        raise ValueError(f"{len(files)} files, over {MAX_FILES}")
    out: list[tuple[str, int, int]] = []
    pieces = 0
    for item in files:
        name, size, piece = item
        if not isinstance(name, str) or type(size) is not int or type(piece) is not int:
            raise ValueError(f"file entry {item!r:.80} is not (name, size, piece size)")
        check_relative_path(name, "<header>")
        if size < 0 or not 0 < piece <= MAX_PIECE:
            raise ValueError(f"{name!r}: size {size} or piece size {piece} out of range (pieces 1 B to 1 GiB)")
        pieces += -(-size // piece)
        if pieces > MAX_PIECES:
            raise ValueError(f"over {MAX_PIECES} pieces (file {name!r} of {size} bytes in pieces of {piece})")
        out.append((name, size, piece))
    return out


def _deadline(head: dict[str, Any], timeout: datetime.timedelta) -> float:
    """When a transfer of the header's declared bytes must be done (``time.monotonic``)."""
    total = sum(size for _, size, _ in head["files"])
    return time.monotonic() + timeout.total_seconds() + total / MIN_RATE

"""The file a tier-0 slot holds: a rank payload's tensors as raw bytes, behind one small header.

``torch.save`` spends most of a tier-0 snapshot's CPU before a byte lands: pickling calls a Python
``persistent_id`` for every object of the payload, the zip framing writes each record through a
Python ``write`` call, and the ~3,000 objects of a rank's state (the config, the RNG states, the
layout of its DP slice) are pickled in a thread that holds the GIL meanwhile. Measured on the tiny
config's 4.5 MB rank payload (84 tensors) on this 2-core machine: ``torch.save`` into the slot
5.4-6.0 ms, 3.3-3.6 ms of it into a sink that discards the bytes; one ``pwrite`` per tensor
from its own memory 0.7-0.9 ms for the same bytes. A snapshot is taken every step, on the
training ranks' cores, so this layout writes the tensors as they are in memory and pickles only
what is left once they are taken out.

Layout (integers little-endian)::

    0        MAGIC (8 bytes)
    8        u64: header length H
    16       header (H bytes): torch.save of {"skeleton": the payload, each tensor replaced by
             (TENSOR_REF, i), "tensors": [(dtype name, shape, offset, nbytes), ...]}
    ...      zeros up to the data start (16 + H rounded up to ALIGN)
    data     tensor i at data start + offset (ALIGN-aligned), its bytes in row-major order

:func:`read` maps the file (private, copy-on-write: a loaded tensor may be written to and the
file never changes) and makes each tensor a view of the mapping: no second copy, no second pass.
It also reads a ``torch.save`` file (tier 1's in-process writers, slots of earlier versions), told
apart by the magic. The header is loaded with ``weights_only=True``: no arbitrary unpickling of a
file another process wrote.

Never: writes a tensor that is not in host memory (a GPU state is copied into the pinned arena
first: :func:`pretrain.checkpointing.async_writer.copy_tensors`), or keeps storage sharing between
tensors (each tensor is written and read back on its own: a view of a larger buffer comes back as
a tensor of its own bytes, which is all the loaders use: they copy into the live state).
"""

from __future__ import annotations

import ctypes
import io
import mmap
import struct
from pathlib import Path
from typing import IO, Any

import torch

MAGIC = b"RPRAW\x00\x01\n"
ALIGN = 64  # torch's own storage alignment in its files; every dtype's alignment divides it
TENSOR_REF = "\0raw-payload-tensor"  # no payload value is a tuple that starts with a NUL string
_PREFIX = struct.Struct("<8sQ")
_ZEROS = bytes(ALIGN)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _take_tensors(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with every tensor replaced by ``(TENSOR_REF, index into tensors)``."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return (TENSOR_REF, len(tensors) - 1)
    if isinstance(value, dict):
        return {k: _take_tensors(v, tensors) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_take_tensors(v, tensors) for v in value)
    return value


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy (valid while ``tensor`` lives)."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


def write(payload: dict[str, Any], fh: IO[bytes]) -> int:
    """Write ``payload`` to ``fh`` (sequential writes from its current position); returns the bytes
    written. Raises TypeError for a tensor not in host memory (a caller's bug)."""
    tensors: list[torch.Tensor] = []
    skeleton = _take_tensors(payload, tensors)
    table = []
    offset = 0
    for i, tensor in enumerate(tensors):
        if tensor.device.type != "cpu":
            raise TypeError(f"raw payload: tensor {i} is on {tensor.device}; copy the state to host memory first")
        if not tensor.is_contiguous():
            tensors[i] = tensor = tensor.contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        table.append((str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, nbytes))
        offset = _aligned(offset + nbytes)
    header = io.BytesIO()
    torch.save({"skeleton": skeleton, "tensors": table}, header)
    head = _PREFIX.pack(MAGIC, header.tell()) + header.getvalue()
    written = fh.write(head)
    written += fh.write(_ZEROS[: _aligned(len(head)) - len(head)])
    for tensor, (_, _, at, nbytes) in zip(tensors, table, strict=True):
        if nbytes:
            written += fh.write(_bytes_of(tensor))
        written += fh.write(_ZEROS[: _aligned(at + nbytes) - at - nbytes])
    fh.flush()  # a sink that hashes large buffers in place is done with them (the copies above die here)
    return written


def is_raw(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(len(MAGIC)) == MAGIC


def read(path: Path) -> dict[str, Any]:
    """The payload in ``path`` (this layout, or a ``torch.save`` file), its tensors views of the
    file mapped copy-on-write. ValueError names the file when the header does not describe it."""
    with open(path, "rb") as fh:
        magic, length = _PREFIX.unpack(fh.read(_PREFIX.size).ljust(_PREFIX.size, b"\0"))
        if magic != MAGIC:
            fh.close()
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        header = torch.load(io.BytesIO(fh.read(length)), map_location="cpu", weights_only=True)
        size = fh.seek(0, io.SEEK_END)
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)  # never empty: the magic is in it
    start = _aligned(_PREFIX.size + length)
    tensors = [_view(mapped, start, size, entry, path) for entry in header["tensors"]]
    return _put_tensors(header["skeleton"], tensors)


def _view(mapped: mmap.mmap, start: int, size: int, entry: Any, path: Path) -> torch.Tensor:
    dtype_name, shape, offset, nbytes = entry
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype) or start + offset + nbytes > size:
        raise ValueError(
            f"{path}: raw payload header names {dtype_name} {shape} at {offset}, past the file's {size} bytes"
        )
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    count = nbytes // dtype.itemsize
    return torch.frombuffer(mapped, dtype=dtype, count=count, offset=start + offset).view(shape)


def _put_tensors(value: Any, tensors: list[torch.Tensor]) -> Any:
    if type(value) is tuple and len(value) == 2 and value[0] == TENSOR_REF:
        return tensors[value[1]]
    if isinstance(value, dict):
        return {k: _put_tensors(v, tensors) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_put_tensors(v, tensors) for v in value)
    return value

"""Torch DCP's ``.metadata`` read without running code: the reshardable and S3 tiers' steps sit on
storage others can write (shared staging, the bucket), and DCP reads that file with
``pickle.load`` (``torch/distributed/checkpoint/filesystem.py``, ``FileSystemReader.read_metadata``,
which Megatron's ``CachedMetadataFileSystemReader`` extends).

Owns :class:`MetadataUnpickler` (``find_class`` admits only what DCP's ``Metadata`` holds: the
classes of ``torch.distributed.checkpoint.metadata`` and ``.planner``, ``_StorageInfo``,
``torch.Size``, torch dtypes, ``torch.serialization._get_layout`` and ``pathlib.PosixPath`` (the
checkpoint id DCP records); anything else, such as an ``os.system`` reduce, is refused before it
is called), :func:`check_step` (the restore's check of a step's ``model/.metadata`` after its
bytes verified, raising VerificationError so that the step is quarantined and the next older one
used), and :func:`install` (DCP's own read of that file goes through the same unpickler, so a file
swapped after the check is refused too).

Never: unpickles with the standard loader, loads tensors, or writes anything.
Called by :mod:`pretrain.checkpointing.reshardable`.
"""

from __future__ import annotations

import inspect
import io
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any, BinaryIO

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
import torch.distributed.checkpoint.planner as dcp_planner

from tiering.errors import VerificationError

METADATA_NAME = ".metadata"
_MODULES = (dcp_metadata, dcp_planner)
_EXTRA = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size")}
_EXTRA |= {("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("pathlib", "PosixPath")}


class MetadataUnpickler(pickle.Unpickler):
    """A pickle reader that builds only DCP metadata objects."""

    def find_class(self, module: str, name: str) -> Any:
        if _allowed(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a class DCP metadata holds (refused, not called)")


def _allowed(module: str, name: str) -> bool:
    if (module, name) in _EXTRA:
        return True
    if module == "torch":
        return isinstance(getattr(torch, name, None), torch.dtype)
    for mod in _MODULES:
        if module == mod.__name__:
            value = getattr(mod, name, None)
            return inspect.isclass(value) and value.__module__ == module
    return False


def load(fh: BinaryIO) -> Any:
    return MetadataUnpickler(fh).load()


def check_step(step_dir: Path) -> None:
    """``step_dir/model/.metadata`` unpickles to a DCP ``Metadata`` with the restricted reader;
    VerificationError (one line naming the file) otherwise."""
    path = step_dir / "model" / METADATA_NAME
    try:
        with open(path, "rb") as fh:
            value = load(fh)
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise VerificationError(path, f"DCP metadata refused: {exc}") from exc
    except OSError as exc:
        raise VerificationError(path, f"DCP metadata unreadable: {exc.strerror or exc}") from exc
    if not isinstance(value, dcp_metadata.Metadata):
        raise VerificationError(path, f"DCP metadata holds a {type(value).__name__}, not Metadata")


def install() -> None:
    """DCP's file-system reader unpickles ``.metadata`` with :class:`MetadataUnpickler` (its writes
    are unchanged). Idempotent."""
    if getattr(dcp_filesystem.pickle, "restricted", False):
        return
    shim = SimpleNamespace(**{k: getattr(pickle, k) for k in dir(pickle) if not k.startswith("__")})
    shim.load = load
    shim.loads = lambda data, **_: load(io.BytesIO(data))
    shim.restricted = True
    dcp_filesystem.pickle = shim  # type: ignore[assignment]

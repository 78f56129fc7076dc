"""Tiered, verified, atomically published training checkpoints, usable without the trainer.

The public API (importing ``tiering`` loads none of it: each name is imported when first used, so
a launcher that needs one name never pays for torch or boto3):

* Publishing a step: :class:`PosixStepPublisher` (``begin`` a unique temporary directory, write,
  ``commit``: manifest with chunked digests, fsync, one atomic rename, ``COMMITTED``) and
  :func:`manifest_for` (a :class:`Manifest`); a published step is never overwritten.
* A file-system tier: :class:`PosixTier` (list, verify, quarantine, pin, retention) over a
  :class:`RunLayout`; retention policies in :mod:`tiering.retention` (:class:`KeepNewest`).
* Verification: :func:`verify_step` (every chunk of every file against the manifest, the
  ``COMMITTED`` marker, no unlisted files), :func:`read_manifest` (structure only).
* The object store: :func:`open_store` (``s3://`` or ``file://``) returns an :class:`ObjectStore`;
  :class:`RemoteTier` uploads published steps, restores the newest verified one, holds the run's
  lease and collects garbage.
* Collectives: :class:`Collective` is the five-method seam to torch.distributed;
  :class:`SingleProcess` runs every tier in one process.
* Errors (:mod:`tiering.errors`): every failure derives from :class:`TieringError`:
  :class:`CheckpointError` (:class:`VerificationError`, :class:`PublishError`, :class:`DiskFull`)
  and :class:`ObjectStoreError` (:class:`ObjectNotFound`, :class:`AccessDenied`).

``tiering`` never imports ``pretrain``: the trainer uses it, not the other way round.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "PosixStepPublisher": "tiering.local.publish",
    "manifest_for": "tiering.local.publish",
    "PosixTier": "tiering.local.posix",
    "RunLayout": "tiering.layout",
    "KeepNewest": "tiering.retention",
    "verify_step": "tiering.verify",
    "read_manifest": "tiering.verify",
    "Manifest": "tiering.manifest",
    "open_store": "tiering.remote.objectstore",
    "ObjectStore": "tiering.remote.objectstore",
    "RemoteTier": "tiering.remote.tier",
    "Collective": "tiering.collective",
    "SingleProcess": "tiering.collective",
    "TieringError": "tiering.errors",
    "CheckpointError": "tiering.errors",
    "VerificationError": "tiering.errors",
    "PublishError": "tiering.errors",
    "DiskFull": "tiering.errors",
    "ObjectStoreError": "tiering.errors",
    "ObjectNotFound": "tiering.errors",
    "AccessDenied": "tiering.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tiering' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # the next access is a plain attribute
    return value

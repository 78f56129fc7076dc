"""The one exception hierarchy of ``tiering``: every failure the library reports derives from
:class:`TieringError`, so a caller can tell "the storage or a checkpoint said no" (catch the root)
from a programming error (``TypeError``, ``KeyError``, ``AssertionError``, ...), which is never
caught and reported as an I/O failure.

* :class:`CheckpointError`: a step cannot be verified, published, restored or leased;
* :class:`RunKeyError`: the run's secret (:mod:`tiering.trust.run_key`) cannot be used;
* :class:`ObjectStoreError`: the object store is unreachable, refused the caller
  (:class:`AccessDenied`), or lacks an object (:class:`ObjectNotFound`), a condition failed
  (:class:`PreconditionFailed`), or a body broke off (:class:`TransferInterrupted`).

Every message is one line naming the file or object and, where there is one, the fix.
"""

from __future__ import annotations

from pathlib import Path


class TieringError(Exception):
    """Root of every error ``tiering`` raises on purpose."""


class CheckpointError(TieringError):
    """Base class of every checkpoint failure the tiers report."""


class VerificationError(CheckpointError):
    """A step failed verification. ``str(err)`` is one line naming the file and the fix."""

    def __init__(self, path: Path | str, reason: str, fix: str = "the step will be skipped and quarantined") -> None:
        self.path = str(path)
        self.reason = reason
        self.fix = fix
        super().__init__(f"{self.path}: {reason}; {fix}")


class PublishError(CheckpointError):
    """A save could not be published; older committed steps are untouched."""


class DiskFull(PublishError):
    """A tier's volume cannot hold the step even after dropping the steps it may drop; one line
    naming the path, the free and needed bytes and the fix."""


class NoVerifiedCheckpoint(CheckpointError):
    """No tier holds a step that verifies."""


class ReplicaRejected(VerificationError):
    """A copy received from a peer does not match its manifest (or the run/step it claims)."""


class AlreadyCommitted(VerificationError):
    """A step that the object store already holds committed with another manifest: never overwritten."""


class RunKeyError(TieringError):
    """The run key file is missing, unreadable, too short, or readable by others (one line, the fix)."""


class UnsafeDirectory(TieringError):
    """A private directory is a symlink, not a directory, or another user's (one line, the fix)."""


class LeaseError(CheckpointError):
    """Another identity owns this run's prefix."""


class ObjectStoreError(TieringError):
    """The store is unreachable or refused a request; ``str(err)`` is one line."""


class ObjectNotFound(ObjectStoreError):
    """The object does not exist (HTTP 404, or a missing file under ``file://``)."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"{key}: no such object")


class AccessDenied(ObjectStoreError):
    """The store refused the caller (HTTP 403): a missing permission, or, for a key that does not
    exist, a caller the store will not tell whether it exists (S3 answers 404 only to a caller allowed
    to list the key's prefix)."""


class PreconditionFailed(ObjectStoreError):
    """A conditional write lost: the object exists (If-None-Match) or changed (If-Match)."""


class TransferInterrupted(ObjectStoreError):
    """A response body broke off before its end (connection reset, read timeout, short body): the
    request can be made again; what arrived of it must be discarded."""

"""The small exception hierarchy of the checkpoint tiers."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(Exception):
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


class NoVerifiedCheckpoint(CheckpointError):
    """No tier holds a step that verifies."""


class ReplicaRejected(VerificationError):
    """A copy received from a peer does not match its manifest (or the run/step it claims)."""


class ObjectStoreError(RuntimeError):
    """The store is unreachable or refused a request; ``str(err)`` is one line."""


class PreconditionFailed(ObjectStoreError):
    """A conditional write lost: the object exists (If-None-Match) or changed (If-Match)."""


class TransferInterrupted(ObjectStoreError):
    """A response body broke off before its end (connection reset, read timeout, short body): the
    request can be made again; what arrived of it must be discarded."""

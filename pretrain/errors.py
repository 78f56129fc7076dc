"""The rank program's own exceptions (a leaf module: it imports nothing from ``pretrain``)."""

from __future__ import annotations

from tiering.errors import CheckpointError


class FreshStartRefused(CheckpointError):
    """Committed steps of the run exist but none can be obtained by every rank: starting from step 0
    would silently throw the run away. One line: where the copies are, why they are unusable, the fix."""

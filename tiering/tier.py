"""The seam every checkpoint tier implements (local NVMe, peer replica, object store)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from tiering.manifest import Manifest


class Tier(Protocol):
    name: str

    def step_dirs(self) -> list[int]:
        """Every published-looking step, newest first (marker not checked)."""
        ...

    def committed_steps(self) -> list[int]:
        """Steps that look published (newest first); not yet verified."""
        ...

    def verify(self, step: int, shard: tuple[int, int] = (0, 1)) -> Manifest:
        """Verify one step; raise VerificationError naming the bad file."""
        ...

    def quarantine(self, step: int, reason: str) -> Path | None:
        """Move a step that failed verification out of the way, keeping it for inspection."""
        ...

    def step_path(self, step: int) -> Path:
        """Where a verified step can be read from on this host."""
        ...

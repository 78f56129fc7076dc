"""Retention policy: which published steps may be deleted. Pure logic, no I/O."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class KeepNewest:
    """Keep the ``keep`` newest verified steps; never the newest verified one or a protected one.

    Steps that did not verify are not counted as kept copies (they are quarantined by restore,
    not deleted here), so a corrupt newer step can never cause the last good copy to be removed.
    """

    keep: int

    def deletable(self, verified: Iterable[int], protected: Iterable[int] = ()) -> list[int]:
        ordered = sorted(set(verified), reverse=True)
        if not ordered:
            return []
        kept = set(ordered[: max(1, self.keep)]) | set(protected)
        return sorted(s for s in ordered if s not in kept)

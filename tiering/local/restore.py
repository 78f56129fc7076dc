"""Choosing the step to restore: newest first, verified collectively, failures quarantined."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tiering.collective import Collective
from tiering.errors import VerificationError
from tiering.manifest import Manifest
from tiering.tier import Tier

log = logging.getLogger(__name__)


@dataclass
class Selection:
    tier: str
    step: int
    manifest: Manifest
    rejected: list[tuple[int, str]]


def select_newest_verified(
    tier: Tier,
    coll: Collective,
    newer_than: int = -1,
    rejected: list[tuple[int, str]] | None = None,
    check: Callable[[Path], None] | None = None,
    exclude: frozenset[int] = frozenset(),
) -> Selection | None:
    """Collective: return the newest step of ``tier`` newer than ``newer_than`` that verifies on
    every rank, or None. Rejections are appended to ``rejected`` when given.

    Rank 0 lists the candidates (``latest.json`` is not trusted); the ranks hash disjoint shares
    of each candidate's files in parallel; a step any rank rejects is quarantined by rank 0 with
    the first reason and the scan falls back to the next older step. ``check(step_dir)``, run by
    rank 0 once the bytes verified, may reject a step too (VerificationError): the reader's own
    check of what it is about to load (DCP metadata read without running code). Steps in
    ``exclude`` (suspects: they restored to a non-finite loss) are never candidates (rank 0's set
    decides, so every rank scans the same list).
    """
    listed = [s for s in tier.step_dirs() if s not in exclude] if coll.rank == 0 else None
    candidates: list[int] = coll.broadcast(listed)
    rejected = [] if rejected is None else rejected
    for step in (s for s in candidates if s > newer_than):
        reason = None
        manifest = None
        try:
            manifest = tier.verify(step, shard=(coll.rank, coll.world_size))
            if check is not None and coll.rank == 0:
                check(tier.step_path(step))
        except VerificationError as exc:
            reason = str(exc)
        reasons = [r for r in coll.all_gather(reason) if r]
        if not reasons and manifest is not None:
            return Selection(tier.name, step, manifest, rejected)
        rejected.append((step, reasons[0]))
        if coll.rank == 0:
            log.error("checkpoint rejected: %s", reasons[0])
            tier.quarantine(step, reasons[0])
        coll.barrier()
    return None

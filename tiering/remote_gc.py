"""Garbage collection of a run's steps in an object store: mark on one pass, delete on a later one.

Kept (:class:`tiering.retention.ObjectStoreRetention`): the newest ``keep`` committed steps whose
manifest verifies, the verified step just before them, milestones, and the step ``latest.json``
names; never the only verified step. Uncommitted leftovers older than the newest committed step
are garbage too (newer ones may be uploads in progress). A step is deleted ``COMMITTED`` first, so
a half-deleted step is never mistaken for a committed one. Called by ``tiering gc`` through
:class:`tiering.remote.RemoteTier`; it never uploads a step.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from tiering.errors import ObjectNotFound, VerificationError
from tiering.manifest import COMMITTED_NAME
from tiering.remote_download import read_remote_manifest
from tiering.remote_run import RemoteRun
from tiering.remote_upload import latest_hint
from tiering.retention import ObjectStoreRetention, StepView

MARKS_KEY = ("gc", "marks.json")


@dataclass
class GcPlan:
    keep: list[int]
    marked_now: list[int]
    deleted: list[int]
    reasons: dict[int, str] = field(default_factory=dict)


def gc(run: RemoteRun, keep: int, milestone_every: int, dry_run: bool = True) -> GcPlan:
    """Mark the steps beyond retention, delete those an earlier pass marked (nothing when ``dry_run``)."""
    all_steps = run.steps()
    verified = [s for s in sorted(all_steps, reverse=True) if _manifest_verifies(run, s, all_steps[s])]
    keep_set = ObjectStoreRetention(keep, milestone_every).keeps(StepView.of(verified, latest=latest_hint(run)))
    candidates = set(verified)
    if verified:
        candidates |= {s for s in all_steps if s < verified[0]}
    doomed = candidates - keep_set
    marks = _read_marks(run)
    plan = GcPlan(sorted(keep_set & set(all_steps)), [], [])
    to_delete = sorted(s for s in doomed if s in marks)
    plan.marked_now = sorted(s for s in doomed if s not in marks)
    plan.deleted = to_delete
    if not dry_run:
        for step in to_delete:
            keys = [o.key for o in run.store.list(run.step_key(step) + "/")]
            # COMMITTED first: a half-deleted step is never mistaken for a committed one.
            keys.sort(key=lambda k: not k.endswith("/" + COMMITTED_NAME))
            run.store.delete(keys[:1])
            run.store.delete(keys[1:])
        remaining = {s: t for s, t in marks.items() if s in doomed and s not in to_delete}
        remaining.update({s: time.time() for s in plan.marked_now})
        run.store.put_bytes(run.key(*MARKS_KEY), json.dumps({str(k): v for k, v in remaining.items()}).encode())
    return plan


def _manifest_verifies(run: RemoteRun, step: int, names: set[str]) -> bool:
    if COMMITTED_NAME not in names:
        return False
    try:
        read_remote_manifest(run, step)
        return True
    except VerificationError:
        return False


def _read_marks(run: RemoteRun) -> dict[int, float]:
    try:
        raw, _ = run.store.get_bytes(run.key(*MARKS_KEY))
    except ObjectNotFound:
        return {}
    try:
        return {int(k): float(v) for k, v in json.loads(raw).items()}
    except (ValueError, AttributeError):  # unreadable marks: start marking again
        return {}

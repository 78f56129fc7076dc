"""Garbage collection of a run's steps in an object store: mark on one pass, delete on a later one.

Kept (:class:`tiering.retention.ObjectStoreRetention`): the newest ``keep`` committed steps that
look restorable (``COMMITTED`` matches the manifest, its ``SIGNATURE`` verifies when the run is
signed, and every object the manifest lists is there with the listed size, from one listing: an
object overwritten or deleted after commit makes the step count as not kept), the verified step
just before them, milestones, and the step ``latest.json``
names; never the only verified step. A step on the run's suspect list (poisoned: it restored to a
non-finite loss) is not counted as verified, so it never takes a good step's place among the kept.
A marked step is deleted only once its mark is ``min_age_s`` old (one hour by default; a mark
dated in the future counts from now): two passes in a row never delete at once. Uncommitted
leftovers older than the newest committed step are garbage too (newer ones may be uploads in
progress). A step is deleted ``COMMITTED`` first, so a half-deleted step is never mistaken for a
committed one. Called by ``tiering gc`` through :class:`tiering.remote.tier.RemoteTier`; it never
uploads a step.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from tiering.errors import ObjectNotFound, VerificationError
from tiering.layout import parse_step_name
from tiering.manifest import COMMITTED_NAME
from tiering.remote.download import read_remote_manifest
from tiering.remote.run import RemoteRun
from tiering.remote.upload import latest_hint
from tiering.retention import ObjectStoreRetention, StepView

MARKS_KEY = ("gc", "marks.json")
MIN_AGE_S = 3600.0  # a mark must be this old before its step is deleted


@dataclass
class GcPlan:
    keep: list[int]
    marked_now: list[int]
    deleted: list[int]
    reasons: dict[int, str] = field(default_factory=dict)


def gc(
    run: RemoteRun,
    keep: int,
    milestone_every: int,
    dry_run: bool = True,
    min_age_s: float = MIN_AGE_S,
    suspects: frozenset[int] = frozenset(),
) -> GcPlan:
    """Mark the steps beyond retention, delete those an earlier pass marked at least ``min_age_s``
    ago (nothing when ``dry_run``); ``suspects`` never count as verified."""
    sizes = _object_sizes(run)
    all_steps = {step: set(objects) for step, objects in sizes.items()}
    verified = [
        s
        for s in sorted(all_steps, reverse=True)
        if s not in suspects and _restorable(run, s, all_steps[s], sizes.get(s, {}))
    ]
    keep_set = ObjectStoreRetention(keep, milestone_every).keeps(StepView.of(verified, latest=latest_hint(run)))
    candidates = set(verified)
    if verified:
        candidates |= {s for s in all_steps if s < verified[0]}
    doomed = candidates - keep_set
    now = time.time()
    marks = {s: min(t, now) for s, t in _read_marks(run).items()}  # a mark from the future counts from now
    plan = GcPlan(sorted(keep_set & set(all_steps)), [], [])
    to_delete = sorted(s for s in doomed if s in marks and now - marks[s] >= min_age_s)
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
        remaining.update({s: now for s in plan.marked_now})
        run.store.put_bytes(run.key(*MARKS_KEY), json.dumps({str(k): v for k, v in remaining.items()}).encode())
    return plan


def _restorable(run: RemoteRun, step: int, names: set[str], sizes: dict[str, int]) -> bool:
    """Whether ``step`` is committed, its manifest verifies (signature included), and every object
    it lists is present with its listed size (``sizes``: relative name -> bytes, from the listing)."""
    if COMMITTED_NAME not in names:
        return False
    try:
        manifest, _ = read_remote_manifest(run, step)
    except VerificationError:
        return False
    return all(sizes.get(entry.path) == entry.bytes for entry in manifest.files)


def _object_sizes(run: RemoteRun) -> dict[int, dict[str, int]]:
    """step -> {relative object name: size}, from one listing of the run's steps."""
    prefix = run.key("steps") + "/"
    out: dict[int, dict[str, int]] = {}
    for obj in run.store.list(prefix):
        name, _, rel = obj.key[len(prefix) :].partition("/")
        step = parse_step_name(name)
        if step is not None and rel:
            out.setdefault(step, {})[rel] = obj.size
    return out


def _read_marks(run: RemoteRun) -> dict[int, float]:
    try:
        raw, _ = run.store.get_bytes(run.key(*MARKS_KEY))
    except ObjectNotFound:
        return {}
    try:
        return {int(k): float(v) for k, v in json.loads(raw).items()}
    except (ValueError, AttributeError):  # unreadable marks: start marking again
        return {}

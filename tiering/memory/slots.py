"""Tier-0 slot rotation and sealing: which slot to write, which to load. Pure logic, no I/O.

A rank keeps its newest states in ``n`` slots (memory-backed files, :mod:`tiering.memory.slot_store`).
Each slot has a header (the slot's ``manifest.json`` and ``COMMITTED`` marker: run id, step,
sequence number, sizes, chunk digests) that is removed before the slot is written and written
again only once every chunk digest is complete, so a slot is either *sealed* (loadable after its
chunks verify) or not loadable at all. This module decides, from what a scan of the slots saw
(:class:`SlotView`):

* :func:`slot_to_write`: an unsealed slot first, else the sealed slot with the oldest sequence;
  never the newest sealed one (a kill during the write leaves the other slot intact), and not one
  the peer stream is sending while another qualifies;
* :func:`next_sequence`: sequence numbers only grow, across restarts;
* :func:`loadable`: sealed slots of this run, newest step first, none older than ``floor`` (a
  slot older than tier 1 or of another run is never used) and none of a suspect step;
* :func:`newer_than`: sealed slots of an abandoned timeline (newer than the step resumed from);
* :func:`common_step`: the newest step every rank holds.

The slot store and the memory tier call it; it never touches a file.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from enum import Enum


class SlotState(Enum):
    EMPTY = "empty"  # no file at all
    UNSEALED = "unsealed"  # a payload without a valid header: being written, torn, or invalidated
    SEALED = "sealed"  # header complete: loadable once its chunks verify


@dataclass(frozen=True)
class SlotView:
    """What a scan saw of one slot (step, sequence and run id only when sealed)."""

    index: int
    state: SlotState
    run_id: str | None = None
    step: int | None = None
    sequence: int | None = None

    @classmethod
    def sealed(cls, index: int, run_id: str, step: int, sequence: int) -> SlotView:
        return cls(index, SlotState.SEALED, run_id, step, sequence)

    @classmethod
    def unsealed(cls, index: int) -> SlotView:
        return cls(index, SlotState.UNSEALED)

    @classmethod
    def empty(cls, index: int) -> SlotView:
        return cls(index, SlotState.EMPTY)


def _sealed(views: Iterable[SlotView]) -> list[SlotView]:
    return [v for v in views if v.state is SlotState.SEALED]


def _order(view: SlotView) -> tuple[int, int]:
    assert view.sequence is not None and view.step is not None
    return view.sequence, view.step


def slot_to_write(views: list[SlotView], run_id: str, pinned: Collection[int] = ()) -> int:
    """The slot the next state goes into: an empty or unsealed one (lowest index), else a slot of
    another run, else the sealed slot with the oldest sequence. With two or more slots this is
    never the newest sealed slot of this run.

    ``pinned``: slots being read by someone else (the peer stream sending a copy). They are passed
    over while another slot qualifies; with two slots and one pinned none does (the other is the
    newest sealed), and the pinned slot is written anyway: the own copy, which bounds every restart's
    loss to one step, comes before the peer's. Three slots always leave one free of both."""
    if len(views) < 2:
        raise ValueError(f"tier 0 needs at least 2 slots, got {len(views)}")
    newest = _newest(views, run_id)
    others = [v for v in views if v.index != newest]
    return _choose([v for v in others if v.index not in pinned] or others, run_id)


def _newest(views: list[SlotView], run_id: str) -> int | None:
    mine = [v for v in _sealed(views) if v.run_id == run_id]
    return max(mine, key=_order).index if mine else None


def _choose(views: list[SlotView], run_id: str) -> int:
    for view in sorted(views, key=lambda v: v.index):
        if view.state is not SlotState.SEALED:
            return view.index
    foreign = [v for v in views if v.run_id != run_id]
    if foreign:
        return min(v.index for v in foreign)
    return min(views, key=_order).index


def next_sequence(views: Iterable[SlotView]) -> int:
    """One more than the highest sequence any sealed slot carries (1 for none)."""
    return max((v.sequence or 0 for v in _sealed(views)), default=0) + 1


def loadable(views: Iterable[SlotView], run_id: str, floor: int = -1, suspect: Iterable[int] = ()) -> list[SlotView]:
    """Sealed slots of ``run_id`` holding a step >= ``floor`` and not suspect, newest first (at
    equal steps the higher sequence first: a later attempt wrote the same step again)."""
    bad = set(suspect)
    mine = [v for v in _sealed(views) if v.run_id == run_id and v.step is not None and v.step >= floor]
    mine = [v for v in mine if v.step not in bad]
    return sorted(mine, key=lambda v: (v.step, v.sequence), reverse=True)


def newer_than(views: Iterable[SlotView], run_id: str, step: int) -> list[int]:
    """Indexes of sealed slots of ``run_id`` newer than ``step`` (an abandoned timeline)."""
    return sorted(v.index for v in _sealed(views) if v.run_id == run_id and v.step is not None and v.step > step)


def common_step(per_rank: list[Iterable[int]]) -> int | None:
    """The newest step present in every rank's list (None if some rank has none in common)."""
    if not per_rank:
        return None
    common = set(per_rank[0])
    for steps in per_rank[1:]:
        common &= set(steps)
    return max(common) if common else None

"""Retention policies on step lists: each building block, their union, and both tiers' presets."""

from __future__ import annotations

import itertools

import pytest

from tiering.retention import (
    AnyOf,
    CustomPolicy,
    EveryNSteps,
    KeepNewest,
    LatestN,
    LatestTarget,
    NewestVerified,
    ObjectStoreRetention,
    Pinned,
    RetentionPolicy,
    StepView,
)

STEPS = (10, 20, 30, 40, 50, 60, 70)


@pytest.mark.parametrize(
    ("policy", "verified", "pinned", "latest", "kept"),
    [
        (LatestN(2), STEPS, (), None, {60, 70}),
        (LatestN(0), STEPS, (), None, set()),
        (LatestN(-3), STEPS, (), None, set()),
        (LatestN(10), (30, 10, 20), (), None, {10, 20, 30}),
        (LatestN(1), (), (), None, set()),
        (EveryNSteps(20), STEPS, (), None, {20, 40, 60}),
        (EveryNSteps(0), STEPS, (), None, set()),
        (EveryNSteps(-5), STEPS, (), None, set()),
        (EveryNSteps(25), (0, 25, 30), (), None, {0, 25}),
        (Pinned(), STEPS, (30, 99), None, {30, 99}),
        (Pinned(), STEPS, (), None, set()),
        (LatestTarget(), STEPS, (), 20, {20}),
        (LatestTarget(), STEPS, (), 99, {99}),
        (LatestTarget(), STEPS, (), None, set()),
        (NewestVerified(), STEPS, (), None, {70}),
        (NewestVerified(), (), (), 5, set()),
        (CustomPolicy(lambda v: [s for s in v.verified if s < 30]), STEPS, (), None, {10, 20}),
        (AnyOf(), STEPS, (), None, set()),
        (AnyOf(LatestN(1), EveryNSteps(30), LatestTarget()), STEPS, (), 10, {10, 30, 60, 70}),
        (AnyOf(Pinned(), AnyOf(LatestN(1))), STEPS, (20,), None, {20, 70}),
    ],
)
def test_each_policy_keeps(
    policy: RetentionPolicy, verified: tuple[int, ...], pinned: tuple[int, ...], latest: int | None, kept: set[int]
) -> None:
    assert policy.keeps(StepView.of(verified, pinned, latest)) == kept


@pytest.mark.parametrize(
    ("policy", "verified", "protected", "latest", "candidates", "deletable"),
    [
        # POSIX tiers
        (KeepNewest(1), (), (), None, None, []),
        (KeepNewest(0), (5,), (), None, None, []),  # the newest verified step is never deletable
        (KeepNewest(-1), (5, 6), (), None, None, [5]),
        (KeepNewest(2), (1, 2, 3, 4), (), None, None, [1, 2]),
        (KeepNewest(1), (1, 2, 3), (1,), None, None, [2]),
        (KeepNewest(3), STEPS, (), 10, None, [10, 20, 30, 40]),  # latest.json is no reason to keep here
        # object store GC: keep 2 + the one before, milestones of 50, and the step latest.json names
        (ObjectStoreRetention(2, 50), STEPS, (), 20, None, [10, 30, 40]),
        (ObjectStoreRetention(1, 0), (10,), (), None, None, []),  # never the only verified step
        (ObjectStoreRetention(0, 0), (10, 20), (), None, None, [10]),
        (ObjectStoreRetention(1, 0), (10, 20, 30), (), None, (5, 10, 15), [5, 10, 15]),
        (ObjectStoreRetention(1, 0), (10, 20, 30), (), 15, (5, 10, 15), [5, 10]),
        # a policy of its own
        (AnyOf(NewestVerified(), CustomPolicy(lambda v: v.verified[-1:])), (1, 2, 3), (), None, None, [2]),
    ],
)
def test_deletable(
    policy: RetentionPolicy,
    verified: tuple[int, ...],
    protected: tuple[int, ...],
    latest: int | None,
    candidates: tuple[int, ...] | None,
    deletable: list[int],
) -> None:
    assert policy.deletable(verified, protected, latest, candidates) == deletable


def _subsets(steps: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [c for r in range(len(steps) + 1) for c in itertools.combinations(steps, r)]


@pytest.mark.parametrize("keep", [0, 1, 2, 3])
def test_keep_newest_matches_the_rule_it_replaced(keep: int) -> None:
    """The POSIX rule before composable policies: the ``max(1, keep)`` newest verified plus protected."""
    for verified in _subsets((1, 2, 3, 4, 5)):
        for protected in _subsets((2, 4)):
            ordered = sorted(verified, reverse=True)
            kept = set(ordered[: max(1, keep)]) | set(protected)
            expected = sorted(s for s in ordered if s not in kept)
            assert KeepNewest(keep).deletable(verified, protected) == expected, (verified, protected)


@pytest.mark.parametrize(("keep", "milestone_every"), [(1, 0), (2, 0), (1, 20), (3, 40), (2, 100)])
def test_object_store_retention_matches_the_rule_it_replaced(keep: int, milestone_every: int) -> None:
    """The GC rule before composable policies, on every subset of verified steps and latest hints."""
    for verified in _subsets((20, 40, 60, 80, 100)):
        for latest in (None, 40, 90):
            ordered = sorted(verified, reverse=True)
            kept = set(ordered[: keep + 1]) | (
                {s for s in ordered if s % milestone_every == 0} if milestone_every else set()
            )
            kept |= {latest} if latest is not None else set()
            view = StepView.of(verified, latest=latest)
            assert ObjectStoreRetention(keep, milestone_every).keeps(view) == kept, (verified, latest)


def test_step_view_orders_newest_first_and_dedups() -> None:
    view = StepView.of([10, 30, 20, 30], pinned=[5], latest=7)
    assert view == StepView((30, 20, 10), frozenset({5}), 7)

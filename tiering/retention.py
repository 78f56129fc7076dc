"""Retention: which steps of a tier are kept. Pure logic on step numbers, no I/O.

A policy names the steps it keeps; a tier deletes only candidates that no policy keeps. Every
tier composes the same building blocks with :class:`AnyOf` (a step is kept if any policy keeps it):

* :class:`LatestN`: the n newest verified steps;
* :class:`EveryNSteps`: milestones, the verified steps divisible by n;
* :class:`Pinned`: steps in use by another process (an upload, a restore) or protected by the caller;
* :class:`LatestTarget`: the step ``latest.json`` names;
* :class:`NewestVerified`: the newest verified step, so the last good copy is never deleted;
* :class:`CustomPolicy`: any function of the :class:`StepView`.

:class:`KeepNewest` is the POSIX tiers' policy (per-rank local, peer replica, reshardable
staging); :class:`ObjectStoreRetention` is the object store's GC policy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StepView:
    """What retention sees of a tier: verified steps (newest first), pinned steps, latest.json's step.

    Steps that did not verify are never in ``verified``: they do not count as kept copies (restore
    quarantines them), so a corrupt newer step can never cause the last good copy to be removed.
    """

    verified: tuple[int, ...] = ()
    pinned: frozenset[int] = frozenset()
    latest: int | None = None

    @classmethod
    def of(cls, verified: Iterable[int], pinned: Iterable[int] = (), latest: int | None = None) -> StepView:
        return cls(tuple(sorted(set(verified), reverse=True)), frozenset(pinned), latest)


class RetentionPolicy(ABC):
    """One rule of retention: the steps it keeps."""

    @abstractmethod
    def keeps(self, view: StepView) -> set[int]:
        """The steps this policy keeps (they need not all exist in the tier)."""

    def deletable(
        self,
        verified: Iterable[int],
        protected: Iterable[int] = (),
        latest: int | None = None,
        candidates: Iterable[int] | None = None,
    ) -> list[int]:
        """``candidates`` (default: the verified steps) that this policy does not keep, oldest first."""
        view = StepView.of(verified, protected, latest)
        kept = self.keeps(view)
        pool = set(view.verified if candidates is None else candidates)
        return sorted(pool - kept)


@dataclass(frozen=True)
class LatestN(RetentionPolicy):
    """The ``n`` newest verified steps (none if ``n <= 0``)."""

    n: int

    def keeps(self, view: StepView) -> set[int]:
        return set(view.verified[: max(0, self.n)])


@dataclass(frozen=True)
class EveryNSteps(RetentionPolicy):
    """Milestones: verified steps divisible by ``n`` (none if ``n <= 0``)."""

    n: int

    def keeps(self, view: StepView) -> set[int]:
        return {s for s in view.verified if s % self.n == 0} if self.n > 0 else set()


@dataclass(frozen=True)
class Pinned(RetentionPolicy):
    """Steps in use (pinned by a live process) or protected by the caller."""

    def keeps(self, view: StepView) -> set[int]:
        return set(view.pinned)


@dataclass(frozen=True)
class LatestTarget(RetentionPolicy):
    """The step ``latest.json`` names, verified or not (an operator may point it at an old step)."""

    def keeps(self, view: StepView) -> set[int]:
        return {view.latest} if view.latest is not None else set()


@dataclass(frozen=True)
class NewestVerified(RetentionPolicy):
    """The newest verified step: whatever else a policy says, the last good copy stays."""

    def keeps(self, view: StepView) -> set[int]:
        return set(view.verified[:1])


@dataclass(frozen=True)
class CustomPolicy(RetentionPolicy):
    """Keeps whatever ``rule`` returns for the view."""

    rule: Callable[[StepView], Iterable[int]]

    def keeps(self, view: StepView) -> set[int]:
        return set(self.rule(view))


class AnyOf(RetentionPolicy):
    """A step is kept if any of ``policies`` keeps it."""

    def __init__(self, *policies: RetentionPolicy) -> None:
        self.policies = policies

    def keeps(self, view: StepView) -> set[int]:
        kept: set[int] = set()
        for policy in self.policies:
            kept |= policy.keeps(view)
        return kept

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(map(repr, self.policies))})"


@dataclass(frozen=True)
class KeepNewest(RetentionPolicy):
    """POSIX tiers: the ``keep`` newest verified steps and the pinned ones; never the newest verified one."""

    keep: int

    def keeps(self, view: StepView) -> set[int]:
        return AnyOf(LatestN(self.keep), Pinned(), NewestVerified()).keeps(view)


@dataclass(frozen=True)
class ObjectStoreRetention(RetentionPolicy):
    """Object store GC: the newest ``keep`` verified steps and the verified step before them,
    milestones (``step % milestone_every == 0``), the step latest.json names, pinned steps, and
    never the newest verified one."""

    keep: int
    milestone_every: int = 0

    def keeps(self, view: StepView) -> set[int]:
        return AnyOf(
            LatestN(self.keep + 1),  # the newest `keep` plus the previous verified one
            EveryNSteps(self.milestone_every),
            LatestTarget(),
            Pinned(),
            NewestVerified(),
        ).keeps(view)

"""The seam between the checkpoint manager and a checkpoint tier (per-rank tier 1-2, reshardable).

A tier knows its own schedule (``due``), saves synchronously or in the background (start, poll,
abandon), and cleans up what earlier attempts left (``prepare``). Every call that takes or
returns a save is collective over the training group: all ranks call it at the same step.
Restores are tier-specific (a peer plan for tiers 1-2, a resharding load for the reshardable
tier) and are ordered by :class:`pretrain.checkpointing.tiered.TieredCheckpointer`.
"""

from __future__ import annotations

from typing import Protocol

from pretrain.checkpointing.state import SaveResult, TrainingState


class CheckpointTier(Protocol):
    name: str

    def due(self, step: int, final: bool) -> bool:
        """Whether this tier saves at ``step`` (``final``: the run's last step)."""
        ...

    @property
    def in_flight(self) -> int | None:
        """The step of the background save not yet published on this rank, if any."""
        ...

    def busy(self) -> bool:
        """Collective: whether any rank still has a background save in flight."""
        ...

    def prepare(self) -> None:
        """At start-up: drop the temporary directories of earlier attempts."""
        ...

    def save(self, state: TrainingState, deadline: float | None = None) -> SaveResult:
        """Collective, synchronous; raises PublishError on every rank if the step is not published."""
        ...

    def start_async(self, state: TrainingState) -> float:
        """Collective: snapshot ``state`` and write it in the background; returns seconds blocked."""
        ...

    def poll_async(self, block: bool = False) -> SaveResult | None:
        """Collective: publish the background save once every rank's writer finished (None: not yet)."""
        ...

    def abandon_async(self) -> None:
        """After a failure: stop the background writer; its step is never committed."""
        ...

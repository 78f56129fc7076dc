"""The seam between the checkpoint manager and a checkpoint tier (per-rank tier 1-2, reshardable).

A tier knows its own schedule (``due``), saves synchronously or in the background (start, poll,
abandon), and cleans up what earlier attempts left (``prepare``). Every call that takes or
returns a save is collective over the training group: all ranks call it at the same step.
Restores are tier-specific (a peer plan for tiers 1-2, a resharding load for the reshardable
tier) and are ordered by :class:`pretrain.checkpointing.tiered.TieredCheckpointer`.

:class:`TierSet` is the seam between the checkpoint manager and the tiers as a whole (what
``TieredCheckpointer`` is to it): the manager's policy (what is due, waiting or skipping while a
save is in flight, the emergency save) is tested in one process against tiers that need no
process group (``tests/test_checkpoint_manager.py``).
"""

from __future__ import annotations

from typing import Protocol

from pretrain.checkpointing.state import RestoreResult, SaveResult, TrainingState


class CheckpointTier(Protocol):
    name: str
    # True when a save's work on the training thread, and the wait for it, fit in a training step
    # (tier 0: a tmpfs write the optimizer step waits for anyway): the manager leaves it in the
    # ``step`` section, judged by the measured step timeout. False: the ``checkpointing`` section.
    within_step: bool

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

    def poll_async(self, block: bool = False, stop_when_idle: bool = False) -> SaveResult | None:
        """Collective: publish the background save once every rank's writer finished (None: not yet).
        ``stop_when_idle``: a blocking wait returns None once a stall of the write is suspected
        (a tier whose stall verdict could outlast the checkpointing section; a tier whose
        blocking wait is bounded below it waits as ``block`` says)."""
        ...

    def abandon_async(self) -> None:
        """After a failure: stop the background writer; its step is never committed."""
        ...

    def poll_fits_in_step(self) -> bool:
        """Collective while a save is in flight, before the step's non-blocking poll: True when that
        poll only checks on the save (tier 0's seal; tier 1, whose commit runs on a publisher
        thread; the reshardable tier while a writer runs), False when it may publish on the
        training thread (the reshardable tier's finalize and commit, once every writer ended):
        the manager then judges it by the ``checkpointing`` section, as a save."""
        ...


class TierSet(Protocol):
    """The tiers of one run, in save order, as the checkpoint manager and the save report use them."""

    @property
    def tier1(self) -> CheckpointTier | None:
        """Tier 1 as the trainer saves to it (the emergency save goes there), if enabled."""
        ...

    def prepare(self) -> None: ...

    def restore(self, state: TrainingState) -> RestoreResult | None:
        """Collective: load the newest step every rank can obtain from any tier; None if none."""
        ...

    def due(self, step: int) -> list[CheckpointTier]: ...

    def background_tiers(self) -> list[CheckpointTier]: ...

    def before_optimizer_step(self) -> float: ...

    def in_flight_count(self) -> int: ...

    def stall_deadline_s(self) -> float:
        """Collective (the same on every rank): the longest any tier lets a save in flight go on
        before it calls that save stalled; 0 when no tier has such a deadline."""
        ...

    def committed(self, step: int) -> None:
        """A save of ``step`` was published (in the foreground or the background)."""
        ...

"""Tier 1 through the node's checkpoint agent (``checkpoint.agent.enabled`` with tier 0 on).

To the checkpoint manager this is tier 1 (``local``): due at ``checkpoint.local.interval``, saved
in the background, polled every step. Its save asks the node's agent to publish the tier-0 slot
that holds the step (sealed by :class:`~pretrain.checkpointing.memory_tier.MemoryTier` before the
optimizer step) and its poll asks the agent what it persisted; both are messages on a local socket,
so a stalled tier-1 volume holds the agent, never the training thread. Every rank reports its own
outcome and the ranks agree (a status exchange, as the other tiers do): a step counts as saved in
tier 1 when every rank's agent has published its part, and that step is the *floor* every agent
keeps from then on, whatever its own retention says.

Never: reads or writes the tier-1 volume after the restore (the restore and the emergency save of
a step tier 0 does not hold use :class:`~pretrain.checkpointing.per_rank.PerRankCheckpoints`, the
``fallback``), or waits on the agent longer than its timeouts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pretrain.checkpointing.state import SaveResult, TrainingState
from pretrain.checkpointing.tier_health import STALLED
from pretrain.errors import AgentGone
from tiering.collective import Collective
from tiering.errors import PublishError

log = logging.getLogger(__name__)

RUNNING = "running"
POLL_S = 0.02  # a blocking wait asks the agent this often


class SealedSlots(Protocol):
    """What the agent tier needs of tier 0 (:class:`~pretrain.checkpointing.memory_tier.MemoryTier`)."""

    def sealed_slot(self, step: int) -> int | None:
        """This rank's slot sealed with ``step`` (None: none; :meth:`sealing` says if one will be)."""
        ...

    def sealing(self, step: int) -> bool:
        """Whether this rank's tier-0 write of ``step`` is still in flight."""
        ...

    def wait_sealed(self, timeout: float) -> None: ...

    def pin(self, slots: frozenset[int]) -> None:
        """Slots the agent is still copying: passed over by the next snapshots while others qualify."""
        ...


class Link(Protocol):
    """A request to the node's agent and its answer (:class:`~pretrain.checkpointing.agent.client.AgentLink`)."""

    def request(self, message: dict) -> dict: ...


class Fallback(Protocol):
    """The in-process tier 1, for a synchronous save of a step tier 0 does not hold."""

    def save(self, state: TrainingState, deadline: float | None = None) -> SaveResult: ...


@dataclass
class _Pending:
    step: int
    t0: float
    slot: int | None = None  # set once the agent was asked
    nbytes: int = 0


class AgentTier:
    name = "local"
    within_step = True  # its work on the training thread is a socket message and a status exchange

    def __init__(
        self,
        coll: Collective,
        interval: int,
        memory: SealedSlots,
        link: Link,
        fallback: Fallback,
        stall_deadline_s: float,
        where: Path,
        final_step: int,
    ) -> None:
        self.coll = coll
        self.rank = coll.rank
        self.interval = interval
        self.memory = memory
        self.link = link
        self.fallback = fallback
        self.stall_deadline_s = stall_deadline_s
        self.where = where  # this rank's tier-1 steps (reported, never touched here)
        self.final_step = final_step  # once persisted, the agent may exit when the ranks are gone
        self.floor: int | None = None  # the newest step every rank's agent persisted
        self._pending: _Pending | None = None
        self._gone_reported = False

    # -- the CheckpointTier protocol ---------------------------------------------------------------
    def due(self, step: int, final: bool) -> bool:
        return final or step % self.interval == 0

    @property
    def in_flight(self) -> int | None:
        return self._pending.step if self._pending is not None else None

    def busy(self) -> bool:
        return any(self.coll.all_gather(self.in_flight is not None))

    def prepare(self) -> None:
        """Nothing: the agent cleans what an earlier agent left, the restore read tier 1."""

    def poll_fits_in_step(self) -> bool:
        return True

    def start_async(self, state: TrainingState) -> float:
        """Collective: remember the step; the agent is asked once tier 0 sealed it (at this step's
        poll or a later one). Refused on every rank (PublishError) where tier 0 did not snapshot
        the step on every rank (it skipped a busy step). Returns the seconds training was blocked."""
        assert self._pending is None, "one tier-1 save in flight at most"
        if not all(self.coll.all_gather(self._held_by_tier0(state.step))):
            raise PublishError(f"tier 1 save of step {state.step} skipped: tier 0 did not snapshot it on every rank")
        self._pending = _Pending(state.step, time.perf_counter())
        return 0.0

    def _held_by_tier0(self, step: int) -> bool:
        return self.memory.sealing(step) or self.memory.sealed_slot(step) is not None

    def save(self, state: TrainingState, deadline: float | None = None) -> SaveResult:
        """Collective, synchronous (a preemption's emergency save, or no background saves): through
        the agent when tier 0 holds or is sealing the step on every rank, else the in-process tier 1."""
        if not all(self.coll.all_gather(self._held_by_tier0(state.step))):
            return self.fallback.save(state, deadline)
        self.start_async(state)
        result = self._wait(deadline)
        assert result is not None
        return result

    def poll_async(self, block: bool = False, stop_when_idle: bool = False) -> SaveResult | None:
        """Collective while a save is in flight: the SaveResult once every rank's agent published
        its part; PublishError on every rank if any rank's could not (older steps are intact)."""
        if self._pending is None:
            return None
        if block and not stop_when_idle:
            return self._wait(None)
        # Not blocking, or a wait the manager may cut short (a save due while this one is in
        # flight): never wait on the agent's storage; the manager skips the save that found it busy.
        return self._exchange(self._status())

    def abandon_async(self) -> None:
        """Leaving after a failure: the agent finishes what it was asked (nothing to stop here)."""
        self._pending = None
        self.memory.pin(frozenset())

    # -- internals -------------------------------------------------------------------------------
    def _wait(self, deadline: float | None) -> SaveResult | None:
        limit = time.monotonic() + self.stall_deadline_s
        if deadline is not None:
            limit = min(limit, deadline)
        while True:
            status = self._status(block=True)
            if status == RUNNING and time.monotonic() > limit:
                status = f"stalled: the agent did not persist step {self.in_flight} within {self.stall_deadline_s:.1f}s"
            result = self._exchange(status)
            if result is not None or self._pending is None:
                return result
            time.sleep(POLL_S)

    def _status(self, block: bool = False) -> str:
        """This rank's part: ``running``, ``ok``, or why it failed (one line)."""
        job = self._pending
        assert job is not None
        try:
            if job.slot is None:
                return self._ask_agent(job, block)
            answer = self.link.request({"op": "status", "rank": self.rank, "floor": self.floor})
        except AgentGone as exc:
            return self._gone(exc)
        persisted = answer["ranks"].get(str(self.rank), {})
        failed = persisted.get("failed", {}).get(str(job.step))
        busy = job.step in answer["queued"] or (answer["current"] or {}).get("step") == job.step
        if job.step in persisted.get("persisted", []) and not busy:
            self.memory.pin(frozenset())
            return "ok"
        if failed is None and not busy:
            # Neither done, failed, queued nor in progress: the agent that took the request died
            # and a new one answers. Ask it again (idempotent; a slot rewritten since is torn).
            self.link.request({"op": "persist", "rank": self.rank, "slot": job.slot, "step": job.step})
            return RUNNING
        failed = failed or self._stalled(answer)
        if failed is not None:
            self.memory.pin(frozenset())
            return failed
        return RUNNING

    def _stalled(self, answer: dict) -> str | None:
        """Why the agent counts as stalled: its request in progress ran past the stall deadline
        (its storage holds it; the agent keeps it and publishes it if the storage answers)."""
        current, since = answer.get("current"), answer.get("current_since")
        if not current or since is None or answer["updated"] - since <= self.stall_deadline_s:
            return None
        return (
            f"{STALLED}: the checkpoint agent has been persisting rank {current['rank']}'s step {current['step']} "
            f"for {answer['updated'] - since:.1f}s (deadline {self.stall_deadline_s:.1f}s)"
        )

    def _ask_agent(self, job: _Pending, block: bool) -> str:
        """Tier 0 sealed the step: ask the agent to persist its slot. Raises AgentGone."""
        if block and self.memory.sealing(job.step):
            self.memory.wait_sealed(self.stall_deadline_s)
        slot = self.memory.sealed_slot(job.step)
        if slot is None:
            if self.memory.sealing(job.step):
                return RUNNING
            return f"tier 0 holds no sealed slot of step {job.step} (tier 1 persists tier 0's snapshots)"
        stalled = self._stalled(self.link.request({"op": "status", "rank": self.rank, "floor": self.floor}))
        if stalled is not None:  # queue nothing behind a request the storage holds
            return stalled
        self.link.request({"op": "persist", "rank": self.rank, "slot": slot, "step": job.step, "floor": self.floor})
        job.slot = slot
        self.memory.pin(frozenset({slot}))
        return RUNNING

    def _release_agent(self) -> None:
        """The run's final step is persisted everywhere: the agent may exit once this rank leaves."""
        try:
            self.link.request({"op": "finish"})
        except AgentGone as exc:
            log.info("rank %d: %s (after the final step: nothing lost)", self.rank, exc)

    def _gone(self, exc: AgentGone) -> str:
        if not self._gone_reported:
            log.warning(
                "rank %d: %s; training goes on with tier 0 alone; the next save starts a new agent", self.rank, exc
            )
            self._gone_reported = True
        self.memory.pin(frozenset())
        return str(exc)

    def _exchange(self, status: str) -> SaveResult | None:
        """Collective: every rank's status; None while any rank's part is running."""
        job = self._pending
        assert job is not None
        statuses = self.coll.all_gather(status)
        if RUNNING in statuses:
            return None
        self._pending = None
        failed = next(((r, s) for r, s in enumerate(statuses) if s != "ok"), None)
        if failed is not None:
            raise PublishError(f"step {job.step} is not complete in tier 1: rank {failed[0]}: {failed[1]}")
        self.floor = job.step
        self._gone_reported = False
        if job.step == self.final_step:
            self._release_agent()
        seconds = time.perf_counter() - job.t0
        return SaveResult(self.name, job.step, seconds, job.nbytes, self.where, blocked_seconds=0.0)

"""Tier 0's peer copy: each rank's sealed slots streamed into its tier-2 peer's tmpfs, and sent
back from there to a rank whose node was lost.

The holder keeps them at ``<memory dir>/<run id>/peers/rank-NNNNN/slot-K`` (the owner's rank), in
the owner's slot layout (:class:`tiering.memory.slot_store.SlotStore` with ``peer=True``), so ``tiering ls``
and ``tiering verify`` read them; at most ``slots`` copies per owner, one of them being received.

* :class:`PeerSlots` runs one exchange on the peer stream's own gloo group through
  :class:`tiering.peer.transport.Transport`. :meth:`PeerSlots.stream_round` sends this rank's offered
  slot to its holders (verified chunk by chunk as it is read, so a slot rewritten meanwhile fails
  the send instead of travelling torn) and receives each owner's into the slot
  :func:`tiering.memory.slots.slot_to_write` picks: unsealed before its first byte lands, sealed only once
  every chunk matched the owner's manifest. :meth:`PeerSlots.fetch` sends a held copy back to its
  owner, which seals it as one of its own slots.
* :class:`PeerStream` runs the stream rounds on a thread of its own. The training thread only
  offers each slot tier 0 sealed on every rank (never waits). A stream that falls behind sends the
  newest offer and counts the offers it skipped; it keeps the newest offer and a count, nothing
  more. Every rank runs one round per offer (offers follow tier 0's collective seal), so each
  pair's messages match.

Never: decides which step a run restores (:mod:`pretrain.checkpointing.memory_tier`), uses the
training process group, writes a slot it has not checked, or loads a state.
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tiering.errors import PublishError, VerificationError
from tiering.local.publish import ReceivedStep, check_received
from tiering.memory.slot_store import SlotStore
from tiering.memory.slots import SlotState, loadable, next_sequence, slot_to_write
from tiering.peer.transport import OutgoingStep, Transport

log = logging.getLogger(__name__)

KIND = "tier0"  # the header kind of a tier-0 slot on the wire (a replica of tier 1 is "replica")


@dataclass(frozen=True)
class Offer:
    """A slot tier 0 sealed on every rank: what the stream may send."""

    step: int
    slot: int
    sequence: int


@dataclass
class RoundReport:
    sent: int | None = None  # the step this rank sent to its holders (None: nothing this round)
    received: dict[int, int] = field(default_factory=dict)  # owner -> step sealed here
    errors: list[str] = field(default_factory=list)  # one line each


@dataclass
class FetchOutcome:
    slot: int | None = None  # the own slot the fetched copy was sealed in (owners only)
    error: str | None = None  # why this rank's part failed (None: fine, or nothing to do)


class PeerSlots:
    """This rank's own slots (``own``) and the peer copies it holds for ``owners_held``."""

    def __init__(
        self, own: SlotStore, holders: dict[int, list[int]], transport: Transport, verify_threads: int = 2
    ) -> None:
        self.own = own
        self.rank = own.rank
        self.run_id = own.run_id
        self.transport = transport
        self.verify_threads = verify_threads
        self.holders_of_mine = list(holders.get(self.rank, []))
        self.owners_held = sorted(o for o, hs in holders.items() if self.rank in hs and o != self.rank)
        self.held = {o: SlotStore(own.root, own.run_id, o, own.slots, peer=True) for o in self.owners_held}

    # -- streaming -------------------------------------------------------------------------------
    def stream_round(self, offer: Offer | None) -> RoundReport:
        """One exchange with every holder and every owner held (each pair: one header, maybe a
        slot). Never raises for a peer's fault: failures are lines in the report."""
        report = RoundReport()
        payload = self._outgoing(offer, report) if offer is not None and self.holders_of_mine else None
        targets = {o: slot_to_write(store.views(), self.run_id) for o, store in self.held.items()}
        into = {o: self.held[o].slot_dir(i) for o, i in targets.items()}
        received, errors = self.transport.exchange(
            {h: payload for h in self.holders_of_mine}, into, lambda o: self.held[o].invalidate(targets[o])
        )
        if payload is not None and offer is not None:
            if payload.failure is None:
                report.sent = offer.step
            elif self.own.view(offer.slot).sequence != offer.sequence:
                report.errors.append(f"tier-0 slot {offer.slot} (step {offer.step}) was rewritten while it was sent")
            else:
                report.errors.append(f"tier-0 slot of step {offer.step} could not be sent: {payload.failure}")
        for owner, got in received.items():
            error = self._install(self.held[owner], targets[owner], got, owner)
            if error is None:
                report.received[owner] = int(got.header["step"])
            else:
                report.errors.append(error)
        report.errors += [f"peer copy with rank {peer}: {why}" for peer, why in sorted(errors.items())]
        return report

    def _outgoing(self, offer: Offer, report: RoundReport) -> OutgoingStep | None:
        """The offered slot, if it still holds that sealed state (checked again while read)."""
        if self.own.view(offer.slot).sequence != offer.sequence:
            return None  # rewritten already: a newer offer follows
        header = {"run_id": self.run_id, "step": offer.step, "owner": self.rank, "kind": KIND}
        try:
            return OutgoingStep.of(self.own.slot_dir(offer.slot), header, check=True)
        except (VerificationError, OSError) as exc:
            report.errors.append(f"tier-0 slot {offer.slot} (step {offer.step}) not sent: {exc}")
            return None

    def _install(self, store: SlotStore, index: int, got: ReceivedStep, owner: int) -> str | None:
        """Check every chunk of a received slot against the owner's manifest, then seal it (a
        sequence of this store's own, so rotation follows arrival); None, or why it was dropped."""
        slot = store.slot_dir(index)
        try:
            if got.header.get("kind") != KIND:
                raise PublishError(f"{slot}: sender sent a {got.header.get('kind')!r}, not a tier-0 slot")
            manifest = check_received(got, slot, self.run_id, int(got.header.get("step", -1)), owner)
            if manifest.extra.get("tier") != 0:
                raise PublishError(f"{slot}: the manifest received is not a tier-0 slot's")
            others = [v for v in store.views() if v.index != index]
            store.seal_checked(index, manifest, next_sequence(others))
            return None
        except (VerificationError, PublishError, OSError, ValueError) as exc:
            store.invalidate(index)
            shutil.rmtree(slot, ignore_errors=True)  # never held: its memory is freed now
            return f"tier-0 copy from rank {owner} rejected: {exc}"

    def held_bytes(self) -> int:
        """Bytes the copies held here take now (a new copy replaces one, it is not added)."""
        return sum(store.held_bytes() for store in self.held.values())

    # -- restoring -------------------------------------------------------------------------------
    def held_steps(self, floor: int, suspect: set[int]) -> dict[int, list[int]]:
        """owner -> the steps of its sealed copies here (newest first), none older than ``floor``."""
        return {o: [v.step for v in loadable(s.views(), self.run_id, floor, suspect) if v.step is not None]
                for o, s in self.held.items()}  # fmt: skip

    def fetch(self, step: int, plan: dict[int, int]) -> FetchOutcome:
        """Among the ranks in ``plan`` (owner -> holder): each holder sends its copy of ``step``
        (verified while read; a bad copy is quarantined there), each owner receives it into the
        own slot :func:`slot_to_write` picks and seals it once every chunk matched."""
        outgoing: dict[int, OutgoingStep | None] = {}
        sent: dict[int, tuple[int, OutgoingStep | None]] = {}
        for owner, holder in plan.items():
            if holder == self.rank:
                index, payload = self._held_copy(owner, step)
                outgoing[owner] = payload
                sent[owner] = (index, payload)
        target = slot_to_write(self.own.views(), self.run_id) if self.rank in plan else -1
        into = {plan[self.rank]: self.own.slot_dir(target)} if self.rank in plan else {}
        received, errors = self.transport.exchange(outgoing, into, lambda _: self.own.invalidate(target))
        outcome = FetchOutcome()
        for owner, (index, payload) in sent.items():
            if payload is not None and payload.failure is not None and index >= 0:
                moved = self.held[owner].quarantine(index, payload.failure)
                log.warning("rank %d: tier-0 copy of rank %d moved to %s: %s", self.rank, owner, moved, payload.failure)
        if self.rank in plan:
            holder = plan[self.rank]
            if holder in errors:
                outcome.error = f"tier-0 copy of step {step} from rank {holder} failed: {errors[holder]}"
            elif holder not in received:
                outcome.error = f"rank {holder} had no verified tier-0 copy of step {step} to send"
            else:
                outcome.error = self._install(self.own, target, received[holder], self.rank)
                outcome.slot = target if outcome.error is None else None
        return outcome

    def _held_copy(self, owner: int, step: int) -> tuple[int, OutgoingStep | None]:
        store = self.held.get(owner)
        views = [v for v in store.views() if v.step == step and v.state is SlotState.SEALED] if store else []
        if store is None or not views:
            return -1, None
        index = max(views, key=lambda v: v.sequence or 0).index
        header = {"run_id": self.run_id, "step": step, "owner": owner, "kind": KIND}
        try:
            return index, OutgoingStep.of(store.slot_dir(index), header, check=True)
        except (VerificationError, OSError) as exc:
            moved = store.quarantine(index, str(exc))
            log.warning("rank %d: tier-0 copy of rank %d moved to %s: %s", self.rank, owner, moved, exc)
            return -1, None

    def invalidate_newer(self, step: int) -> list[Path]:
        """Unseal held copies newer than the step the run resumes from (an abandoned timeline)."""
        out = []
        for store in self.held.values():
            for view in store.views():
                if view.state is SlotState.SEALED and view.step is not None and view.step > step:
                    store.invalidate(view.index)
                    out.append(store.slot_dir(view.index))
        return out


class RoundRunner(Protocol):
    """What the stream drives: one exchange per offer (:class:`PeerSlots`)."""

    rank: int

    def stream_round(self, offer: Offer | None) -> RoundReport: ...


class PeerStream:
    """Stream rounds on a thread of their own (from :meth:`start`); the training thread only calls
    :meth:`offer` and :meth:`claim_slot_to_write`. Offers made before the start are owed as rounds
    like any others.

    The slot being sent is pinned: tier 0 picks its next slot through :meth:`claim_slot_to_write`,
    which passes the pin to :func:`tiering.memory.slots.slot_to_write`, and a slot claimed for writing is
    never taken for a send until its new state is offered. Without the pin, a send slower than a
    step failed every time once tier 0 rotated back into the slot being read (under load the peer
    copy then never landed with two or three slots)."""

    def __init__(self, slots: RoundRunner, on_report: Callable[[RoundReport], None] | None = None) -> None:
        self.slots = slots
        self._on_report = on_report
        self._cond = threading.Condition()
        self._newest: Offer | None = None
        self._sent: Offer | None = None
        self._rounds = 0  # offers not yet run as a round (one round each, on every rank)
        self._unsent = 0  # offers since the last one sent
        self._skipped = 0  # offers never sent, not yet taken by :meth:`take_skipped`
        self._sending: int | None = None  # the own slot a round is reading now (pinned)
        self._claimed: int | None = None  # the own slot tier 0 is writing now (not to be sent)
        self.skipped_total = 0
        self.crash: BaseException | None = None  # a programming error on the thread: raised by offer
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="tier0-peer-stream", daemon=True)

    def start(self) -> PeerStream:
        self._thread.start()
        return self

    def claim_slot_to_write(self, choose: Callable[[frozenset[int]], int]) -> int:
        """The slot tier 0 writes next: ``choose(pinned)``, the slot being sent passed as pinned;
        claimed until a seal offers it again, so no round starts reading it meanwhile."""
        with self._cond:
            self._claimed = choose(frozenset() if self._sending is None else frozenset({self._sending}))
            return self._claimed

    def offer(self, offer: Offer) -> None:
        if self.crash is not None:
            raise self.crash
        with self._cond:
            if offer.slot == self._claimed:
                self._claimed = None  # its write is sealed: the state offered is the one in it
            self._newest = offer
            self._rounds += 1
            self._unsent += 1
            self._cond.notify()

    def take_skipped(self) -> int:
        with self._cond:
            n, self._skipped = self._skipped, 0
            return n

    def close(self, drain: bool, timeout: float) -> bool:
        """Stop the thread: ``drain`` runs the rounds still owed first (every rank owes the same);
        otherwise they are dropped (the job is failing). True if the thread ended in time."""
        with self._cond:
            if not drain:
                self._rounds = 0
            self._stop = True
            self._cond.notify()
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _next(self) -> tuple[bool, Offer | None]:
        """(run a round?, what to send in it): the newest offer if it was not sent yet."""
        with self._cond:
            while self._rounds == 0 and not self._stop:
                self._cond.wait()
            if self._rounds == 0:
                return False, None
            self._rounds -= 1
            if self._newest is None or self._newest == self._sent or self._newest.slot == self._claimed:
                return True, None  # nothing new, or its slot is being rewritten: a newer offer follows
            skipped = self._unsent - 1
            self._skipped += skipped
            self.skipped_total += skipped
            self._unsent = 0
            self._sent = self._newest
            if skipped:
                log.warning(
                    "rank %d: tier-0 peer copy fell behind: sending step %d, %d older slot(s) skipped (%d in all)",
                    self.slots.rank, self._newest.step, skipped, self.skipped_total,
                )  # fmt: skip
            self._sending = self._newest.slot
            return True, self._newest

    def _run(self) -> None:
        while True:
            go, offer = self._next()
            if not go:
                return
            try:
                report = self.slots.stream_round(offer)
            except Exception as exc:  # a programming error: raised on the training thread by offer
                self.crash = exc
                return
            finally:
                with self._cond:
                    self._sending = None
            for line in report.errors:
                log.warning("rank %d: %s", self.slots.rank, line)
            if self._on_report is not None:
                self._on_report(report)

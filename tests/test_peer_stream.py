"""The tier-0 peer stream's policy, in one process: the slot a round is sending is pinned (tier 0
writes another while one qualifies), a slot tier 0 claimed for writing is never taken for a send
until its new state is offered, and a stream that fell behind sends the newest offer. The rounds
are run by a stand-in for :class:`tiering.memory.peer_slots.PeerSlots` (its exchange needs two ranks and
is tested end to end in tests/test_memory_peer.py); the stream, its thread and its locking are real."""

from __future__ import annotations

import queue
import threading

from tiering.memory.peer_slots import Offer, PeerStream, RoundReport


class HeldRounds:
    """Runs each round only when the test releases it, and records what each round was given."""

    rank = 0

    def __init__(self) -> None:
        self.started: queue.Queue[Offer | None] = queue.Queue()
        self.release = threading.Semaphore(0)

    def stream_round(self, offer: Offer | None) -> RoundReport:
        self.started.put(offer)
        self.release.acquire()
        return RoundReport(sent=offer.step if offer is not None else None)


def _pins_seen(stream: PeerStream) -> frozenset[int]:
    seen: list[frozenset[int]] = []

    def choose(pinned: frozenset[int]) -> int:
        seen.append(pinned)
        return 9

    stream.claim_slot_to_write(choose)
    return seen[0]


def test_the_slot_being_sent_is_pinned_until_its_round_ends() -> None:
    rounds = HeldRounds()
    stream = PeerStream(rounds).start()
    try:
        stream.offer(Offer(step=1, slot=0, sequence=1))
        assert rounds.started.get(timeout=10) == Offer(1, 0, 1)
        assert _pins_seen(stream) == frozenset({0})  # the round is reading slot 0
        rounds.release.release()
        stream.offer(Offer(step=2, slot=1, sequence=2))  # a round with it: the first one has ended
        assert rounds.started.get(timeout=10) == Offer(2, 1, 2)
        rounds.release.release()
    finally:
        rounds.release.release()
        assert stream.close(drain=True, timeout=10)
    assert _pins_seen(stream) == frozenset()


def test_a_slot_claimed_for_writing_is_not_sent_until_its_new_state_is_offered() -> None:
    rounds = HeldRounds()
    stream = PeerStream(rounds).start()
    try:
        stream.offer(Offer(step=1, slot=0, sequence=1))
        assert rounds.started.get(timeout=10) == Offer(1, 0, 1)
        stream.offer(Offer(step=2, slot=1, sequence=2))  # owed a round, behind the one in flight
        assert stream.claim_slot_to_write(lambda pinned: 1) == 1  # tier 0 now rewrites slot 1
        rounds.release.release()
        assert rounds.started.get(timeout=10) is None  # step 2's slot is being rewritten: not read
        stream.offer(Offer(step=3, slot=1, sequence=3))  # the rewrite sealed: slot 1 holds step 3
        rounds.release.release()
        assert rounds.started.get(timeout=10) == Offer(3, 1, 3)
        rounds.release.release()
    finally:
        assert stream.close(drain=True, timeout=10)
    assert stream.skipped_total == 1  # step 2 was never sent


def test_a_stream_behind_sends_the_newest_offer_and_counts_the_skipped() -> None:
    rounds = HeldRounds()
    stream = PeerStream(rounds).start()
    try:
        stream.offer(Offer(step=1, slot=0, sequence=1))
        assert rounds.started.get(timeout=10) == Offer(1, 0, 1)
        for step in (2, 3, 4):
            stream.offer(Offer(step=step, slot=step % 3, sequence=step))
        for _ in range(4):  # one round per offer on every rank: the pairs' messages must match
            rounds.release.release()
        sent = [rounds.started.get(timeout=10) for _ in range(3)]
    finally:
        assert stream.close(drain=True, timeout=10)
    assert sent == [Offer(4, 1, 4), None, None]
    assert stream.skipped_total == 2

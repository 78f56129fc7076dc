"""The checkpoint manager: the one object the training loop talks to about checkpoints.

The loop calls :meth:`CheckpointManager.restore` once, :meth:`before_optimizer_step` and
:meth:`after_step` every step, and :meth:`finish` at the end (:meth:`abandon` after a failure).
Everything else lives here: which tier is due, whether a save runs in the foreground or the
background, waiting for or skipping a save while one is in flight (``checkpoint.async.when_busy``),
publishing finished background saves, the emergency tier-1 save when a preemption signal arrived,
and reporting every outcome (:class:`pretrain.checkpointing.reporting.SaveReport`). Before any tier
snapshots the weights (a save due, the emergency save) it calls ``sync_weights`` where it was given
one: with the parameter all-gather overlapped on CUDA, the weights are current only once that
pending gather is forced (:func:`pretrain.session.weight_sync`). Every method is collective: all
ranks call it at the same step with the same arguments.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from pretrain.checkpointing.reporting import SaveReport
from pretrain.checkpointing.state import RestoreResult, SaveResult, TrainingState
from pretrain.checkpointing.tier import CheckpointTier, TierSet
from pretrain.config import Config
from pretrain.errors import PreemptedError
from pretrain.resilience.faults import maybe_slow_save
from pretrain.resilience.phases import PhaseRecord
from pretrain.resilience.preemption import PreemptionWatch
from pretrain.resilience.rank_monitor import RankMonitor
from tiering.errors import PublishError

log = logging.getLogger("pretrain")
FINISH_POLL_S = 0.1  # between finish()'s polls of the final saves (each a status exchange among the ranks)


class CheckpointManager:
    def __init__(
        self,
        cfg: Config,
        tiers: TierSet,
        state: TrainingState,
        report: SaveReport,
        monitor: RankMonitor,
        watch: PreemptionWatch,
        phases: PhaseRecord | None = None,
        sync_weights: Callable[[], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.sync_weights = sync_weights
        self.tiers = tiers
        self.state = state
        self.report = report
        self.monitor = monitor
        self.watch = watch
        self.phases = phases
        self.background = cfg.checkpoint.async_.enabled

    # -- start -----------------------------------------------------------------------------------
    def restore(self) -> RestoreResult | None:
        """Collective: load the newest verified checkpoint into the state; None if there is none."""
        self.tiers.prepare(self.state)  # with the state: tier 0 checks its tmpfs can hold it
        restored = self.tiers.restore(self.state) if self.cfg.checkpoint.load else None
        runlog = self.report.runlog
        if restored is None:
            log.info("no verified checkpoint: starting from step 0")
            runlog.event("fresh_start")
            return None
        log.info(
            "restored step %d from tier %s in %.2fs (verify %.2fs, rng %s); resuming at step %d",
            restored.step,
            restored.tier,
            restored.seconds,
            restored.verify_seconds,
            "restored" if restored.rng_restored else "re-seeded",
            restored.step + 1,
        )
        fields = ("tier", "step", "seconds", "verify_seconds", "rng_restored", "per_rank", "notes")
        rejected = [{"step": s, "reason": r} for s, r in restored.rejected]
        runlog.event("restore", rejected=rejected, **{k: getattr(restored, k) for k in fields})
        return restored

    # -- every step ------------------------------------------------------------------------------
    def before_optimizer_step(self) -> float:
        """Seconds waited for a background snapshot of the weights the optimizer is about to change."""
        return self.tiers.before_optimizer_step()

    def after_step(self, step: int, leaving: bool) -> None:
        """Save to the tiers due at ``step``, publish finished background saves, and when
        ``leaving`` (every rank agreed on a preemption signal) publish tier 1 and raise PreemptedError.

        Called with the loop's ``step`` section still open, and ends it. Work that fits in a step
        (tier 0's snapshot, the seal the optimizer step waits for anyway; the poll of a save in
        flight that only checks on it) stays in it, judged by the measured step timeout, so a rank
        that hangs there is found within a few step times; any other save, or a poll that may
        publish on this thread (the reshardable tier's finalize), runs in the ``checkpointing``
        section, sized for the slowest save.
        """
        due = self.tiers.due(step)
        saved_local = False
        if leaving or step == self.cfg.train.steps or self._beyond_a_step(due):
            self.monitor.end("step")
            self.monitor.start("checkpointing")  # judged by the checkpointing timeout, not the step's
        if any(not tier.within_step for tier in due):
            maybe_slow_save(self.cfg.fault_tolerance.inject, step)
        if due:
            self._sync_weights()
        # Tier 0 last: the other tiers' writers fork, and a fork should find no other thread of
        # this process at work (tier 0's writer would be one; see tiering.system.hash_threads).
        for tier in sorted(due, key=lambda t: t.within_step):
            if self.background:
                self._start_background(tier, step)
                continue
            try:
                self.report.saved(tier.save(self.state), step)
                saved_local = saved_local or tier is self.tiers.tier1
            except PublishError as exc:
                self.report.failed(tier.name, step, exc)
            self.monitor.beat()
        # Leaving: tier 1 must be durable now; promotion staging is not waited for.
        local = [self.tiers.tier1] if leaving and self.tiers.tier1 is not None else None
        done = self._poll(block=leaving, tiers=local)
        saved_local = saved_local or any(d.tier == "local" and d.step == step for d in done)
        self.monitor.end("checkpointing")
        self.monitor.end("step")
        if leaving:
            self._leave(saved_local)

    # -- end -------------------------------------------------------------------------------------
    def finish(self) -> None:
        """The final step's saves must be durable (and replicated) before the attempt counts as done.

        Waited for as training waits for a save in flight: a non-blocking poll (collective), then a
        heartbeat, until no tier has one on any rank. The launcher's heartbeat timeout then judges
        each poll, as it judges each step, not the whole save: one blocking wait sent no heartbeat
        until the slowest tier published (reshardable saves took 9 s in CI at load 9-14 on 2 cores,
        and an 8 s heartbeat timeout killed every rank of a run that had trained to its last step;
        the restart only restored that step). A lost peer blocks a poll's collective (heartbeats
        stop, the timeout finds it); tiers 1 and 2 end a save that stops progressing by their stall
        deadlines. Heartbeats go on for that long at most (as many rounds on every rank); a save
        still in flight then is waited for without them, as before."""
        rounds = math.ceil(self.tiers.stall_deadline_s() / FINISH_POLL_S)  # collective: agreed
        for _ in range(rounds):
            if not any([tier.busy() for tier in self.tiers.background_tiers()]):  # collective: every tier asked
                return
            self._beyond_a_step([])  # as a step does: whether the next poll may finalize (collective)
            self._poll(block=False)
            self.monitor.beat()
            time.sleep(FINISH_POLL_S)
        self._poll(block=True)

    def abandon(self) -> None:
        """After a failure: stop background writers; their steps are never committed."""
        for tier in self.tiers.background_tiers():
            tier.abandon_async()

    # -- internals -------------------------------------------------------------------------------
    def _sync_weights(self) -> None:
        """Collective where the gather is: make the weights current before a tier snapshots them."""
        if self.sync_weights is not None:
            self.sync_weights()

    def _beyond_a_step(self, due: list[CheckpointTier]) -> bool:
        """Whether this step's checkpoint work may outlast a step: a save due of a tier whose save
        does not fit in a step, or one in flight whose poll may not."""
        busy = [t for t in self.tiers.background_tiers() if t.in_flight is not None]
        fits = [t.poll_fits_in_step() for t in busy]  # each asked: a collective on every rank
        return any(not t.within_step for t in due) or not all(fits)

    def _start_background(self, tier: CheckpointTier, step: int) -> None:
        final = step == self.cfg.train.steps  # the last step is never skipped
        if tier.busy():
            if self.cfg.checkpoint.async_.when_busy == "skip" and not final:
                self.report.skipped(tier.name, step, tier.in_flight)
                return
            # Not past a save suspected stalled (its writer idle for the stall deadline): the
            # verdict takes a deadline more, longer than the checkpointing section may allow, and
            # the waiting rank would be killed (the next polls, one per step, reach the verdict
            # while training goes on).
            self._poll(block=True, tiers=[tier], stop_when_idle=not final)
            if tier.busy():
                self.report.skipped(tier.name, step, tier.in_flight)
                return
        try:
            tier.start_async(self.state)
        except PublishError as exc:  # refused up front on every rank (a full volume): nothing started
            self.report.failed(tier.name, step, exc)
            return
        self.report.queue_changed()

    def _poll(
        self, block: bool, tiers: list[CheckpointTier] | None = None, stop_when_idle: bool = False
    ) -> list[SaveResult]:
        """Collective while a save is in flight: publish each tier's save when every writer is done.
        Returns the saves published now (a failed one is reported and training goes on)."""
        published = []
        for tier in tiers if tiers is not None else self.tiers.background_tiers():
            if tier.in_flight is None:
                continue
            step = tier.in_flight
            try:
                saved = tier.poll_async(block, stop_when_idle)
            except PublishError as exc:
                self.report.queue_changed()
                self.report.failed(tier.name, step, exc)
                continue
            if saved is not None:
                self.report.queue_changed()
                self.report.saved(saved, self.state.step)
                published.append(saved)
        return published

    def _leave(self, saved_local: bool) -> None:
        """Collective (every rank agreed at this step boundary): emergency tier-1 save, then exit."""
        step, local, watch = self.state.step, self.tiers.tier1, self.watch
        published = saved_local
        if local is None:
            outcome = "tier 1 is disabled: no emergency save"
        elif saved_local:
            outcome = f"step {step} was just saved in tier 1"
        else:
            self.monitor.start("checkpointing")
            if self.phases is not None:
                self.phases.enter("emergency_save", step=step)
            self._sync_weights()
            try:
                saved = local.save(self.state, deadline=watch.deadline)
                published = True
                outcome = f"emergency save of step {step} published in {saved.seconds:.2f}s"
            except PublishError as exc:
                outcome = f"emergency save of step {step} not published ({exc})"
        watch.finished()
        if self.report.rank == 0:
            log.warning("%s received: %s; exiting %d", watch.signal_name, outcome, PreemptedError.EXIT_CODE)
        self.report.runlog.event("preempted", signal=watch.signal_name, step=step, published=published, outcome=outcome)
        with watch.ending():  # a watchdog that fired first has recorded the end; it stands
            self.report.records.end(
                "preempted", step, signal=watch.signal_name, emergency=outcome, emergency_published=published
            )
        self.monitor.close()
        raise PreemptedError(f"{watch.signal_name}: {outcome}")

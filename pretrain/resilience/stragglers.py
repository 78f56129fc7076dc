"""Straggler detection: NVRx's ``straggler.Detector`` times each rank's compute, and every
``fault_tolerance.straggler.report_interval`` steps rank 0 names the ranks (and nodes) that are
slower than the fastest one.

What it times: the forward of every micro-batch (section ``forward``) and the whole step (section
``step``, reported for reference: the gradient all-reduce makes it equal on every rank). On a GPU
host the Detector also times CUDA kernels through CUPTI, in the ``forward`` section only and every
:data:`PROFILING_INTERVAL`-th entry (CUPTI's cost bounded), and the GPU score is the one judged:
computed from compute kernels only. NCCL kernels are dropped before scoring (:func:`compute_only`):
with TP/SP or PP a forward holds collectives, and a fast rank's NCCL kernel runs longer while it
waits for the slow one, which would make the fast rank score low. The CPU score (section time) is
exact only with tp = pp = 1 (no collective inside the forward). On a
CPU host CUPTI does not exist (NVRx 0.4.1 imports ``libcupti.so.12`` when the Detector starts), so
the Detector is started with :class:`_NoKernelTiming` in CUPTI's place and the report is built from
the section timings alone (``Detector.generate_report`` would call ``torch.cuda.synchronize``).

Scores (NVRx ``Report``): relative = fastest rank's median / this rank's median (1.0 = fastest),
individual = this rank's best median so far / its current median. A rank is slow when its relative
score is below ``threshold``.

With ``action: restart_without`` rank 0 also decides, at each report, whether a node has been
slow in ``patience`` reports in a row; if so (and another node remains) it adds the slowest such
node, with the reports as evidence, to the run's excluded-nodes file and broadcasts its name:
:attr:`StragglerWatch.excluded` is then set on every rank and ``pretrain.train`` ends the attempt
(:class:`~pretrain.errors.StragglerExcluded`) after the step's saves.

Owns: the Detector's life in one attempt, the report's summary, the consecutive-slow counts and
the exclusion decision. Never: sleeps, changes the training, or talks to a scheduler (``pretrain
launch`` refuses an excluded node; sbatch and Kubernetes keep it out). Called by ``pretrain.train``
(``section``, ``wrap``, ``after_step``, ``close``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pretrain.config import StragglerConfig
from pretrain.platform.compat import straggler_module

# CUPTI times every PROFILING_INTERVAL-th entry of the forward section (NVRx's default, 1, profiles
# every kernel of every micro-batch).
PROFILING_INTERVAL = 10

log = logging.getLogger("pretrain")

FORWARD = "forward"
STEP = "step"


class _NoKernelTiming:
    """CUPTI's manager (``straggler.cupti.CuptiManager``) for a host without CUDA: no kernels, no
    results. Same methods, so the Detector's section timing runs unchanged."""

    def __init__(self, **_: Any) -> None:
        self.is_initialized = False

    def initialize(self) -> None:
        self.is_initialized = True

    def shutdown(self) -> None:
        self.is_initialized = False

    def start_profiling(self) -> None:
        pass

    def stop_profiling(self) -> None:
        pass

    def get_results(self) -> dict[str, Any]:
        return {}

    def reset_results(self) -> None:
        pass


@dataclass
class RankScore:
    rank: int
    node: str
    relative: float  # 1.0 = as fast as the fastest rank
    individual: float  # 1.0 = as fast as this rank's own best


@dataclass
class StragglerReport:
    step: int
    source: str  # "gpu" (CUPTI kernel times) or "forward" (CPU section time)
    scores: list[RankScore]
    slow: list[RankScore] = field(default_factory=list)  # relative < threshold, slowest first
    persistent: list[str] = field(default_factory=list)  # nodes slow for ``patience`` reports in a row

    def line(self) -> str:
        ranks = ", ".join(f"rank {s.rank}@{s.node} rel {s.relative:.2f} ind {s.individual:.2f}" for s in self.scores)
        if not self.slow:
            return f"step {self.step} | stragglers: none ({self.source}: {ranks})"
        names = ", ".join(f"rank {s.rank} on {s.node} ({s.relative:.2f})" for s in self.slow)
        return f"step {self.step} | stragglers: {names} | {self.source}: {ranks}"

    def record(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "source": self.source,
            "scores": [vars(s) for s in self.scores],
            "slow_ranks": [s.rank for s in self.slow],
            "slow_nodes": sorted({s.node for s in self.slow}),
            "persistent_nodes": self.persistent,
        }


class ScoreGauge(Protocol):
    def straggler_score(self, rank: int, node: str, score: float) -> None: ...


class ReportSink(Protocol):
    """Where rank 0 sends a report: the metrics gauge and the run's events."""

    def __call__(self, report: StragglerReport) -> None: ...


def sink_to(metrics: ScoreGauge, event: Callable[..., None]) -> ReportSink:
    """Rank 0's report to ``straggler_score{rank,node}`` and a ``straggler_report`` event."""

    def send(report: StragglerReport) -> None:
        for s in report.scores:
            metrics.straggler_score(s.rank, s.node, s.relative)
        event("straggler_report", **report.record())

    return send


class Exclusions(Protocol):
    """Where rank 0 writes an excluded node with its evidence (the run's excluded-nodes file)."""

    def __call__(self, node: str, **evidence: Any) -> str: ...


class Broadcast(Protocol):
    """Rank 0's value to every rank (``tiering.collective.Collective.broadcast``)."""

    def __call__(self, obj: Any, src: int = 0) -> Any: ...


class StragglerWatch:
    """One attempt's detector. Every method is called on every rank (reports are collectives)."""

    def __init__(
        self,
        cfg: StragglerConfig,
        rank: int,
        node: str,
        sink: ReportSink,
        exclude: Exclusions | None = None,
        broadcast: Broadcast | None = None,
    ) -> None:
        self.cfg, self.rank, self.node, self.sink = cfg, rank, node, sink
        self.exclude, self.broadcast = exclude, broadcast
        self.cuda = torch.cuda.is_available()
        self.detector: Any = None
        self.slow_in_a_row: dict[str, int] = {}
        self.recent: collections.deque[StragglerReport] = collections.deque(maxlen=cfg.patience)
        self.excluded: str | None = None  # set on every rank once a node is excluded
        if cfg.action == "restart_without" and (exclude is None or broadcast is None):
            raise TypeError("restart_without needs exclude and broadcast")
        if cfg.enabled:
            self.detector = _start_detector(node, self.cuda)

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        if self.detector is None:
            yield
            return
        # Kernels of the forward only: the step's include the DP reduce-scatter and PP send/recv.
        with self.detector.detection_section(name, profile_cuda=self.cuda and name == FORWARD):
            yield

    def wrap(self, fn: Callable[..., Any], name: str = FORWARD) -> Callable[..., Any]:
        if self.detector is None:
            return fn

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.section(name):
                return fn(*args, **kwargs)

        return timed

    def after_step(self, step: int) -> StragglerReport | None:
        """Collective every ``report_interval`` steps; rank 0 gets the summary and sends it on."""
        if self.detector is None or step % self.cfg.report_interval:
            return None
        raw = _generate(self.detector, self.cuda)
        report, decided = self.judge(step, raw) if self.rank == 0 else (None, None)
        if self.cfg.action == "restart_without":
            self.excluded = self.broadcast(decided)  # type: ignore[misc]  (checked in __init__)
        return report

    def judge(self, step: int, raw: Any) -> tuple[StragglerReport, str | None]:
        """Rank 0: NVRx's ``Report`` summarised, logged and sent on; the node excluded now, if any."""
        report = self._summarise(step, raw)
        log.info("%s", report.line())
        self.sink(report)
        decided = self._decide(report) if self.cfg.action == "restart_without" else None
        return report, decided

    def _decide(self, report: StragglerReport) -> str | None:
        """Rank 0: the node to exclude now (written to the file), or None. The slowest of the nodes
        slow in ``patience`` reports in a row, never the last node holding a rank that is not slow."""
        self.recent.append(report)
        nodes = {s.node for s in report.scores}
        candidates = [s for s in report.slow if s.node in report.persistent]
        if not candidates:
            return None
        node = candidates[0].node  # report.slow is slowest first
        if nodes <= set(report.persistent):
            log.warning("stragglers: every node is slow (%s); excluding none", ", ".join(sorted(nodes)))
            return None
        evidence = [
            {"step": r.step, "source": r.source, "relative": {str(s.rank): round(s.relative, 4) for s in r.scores}}
            for r in self.recent
        ]
        slowest = min(s.relative for s in report.scores if s.node == node)
        reason = (
            f"slow in {self.slow_in_a_row[node]} straggler reports in a row up to step {report.step}: relative "
            f"score {slowest:.2f} < fault_tolerance.straggler.threshold={self.cfg.threshold}"
        )
        ranks = sorted(s.rank for s in report.scores if s.node == node)
        path = self.exclude(node, reason=reason, step=report.step, ranks=ranks, reports=evidence)  # type: ignore[misc]
        log.error("stragglers: excluding node %s (%s): %s; the job restarts without it", node, reason, path)
        return node

    def _summarise(self, step: int, raw: Any) -> StragglerReport:
        source = "gpu" if self.cuda and raw.gpu_relative_perf_scores else FORWARD
        if source == "gpu":
            rel, ind = raw.gpu_relative_perf_scores, raw.gpu_individual_perf_scores
        else:
            rel = raw.section_relative_perf_scores.get(FORWARD, {})
            ind = raw.section_individual_perf_scores.get(FORWARD, {})
        scores = [
            RankScore(r, raw.rank_to_node.get(r, "?"), float(rel[r]), float(ind.get(r, math.nan)))
            for r in sorted(rel)
            if not math.isnan(rel[r])
        ]
        slow = sorted((s for s in scores if s.relative < self.cfg.threshold), key=lambda s: s.relative)
        slow_nodes = {s.node for s in slow}
        for node in {s.node for s in scores}:
            self.slow_in_a_row[node] = self.slow_in_a_row.get(node, 0) + 1 if node in slow_nodes else 0
        persistent = sorted(n for n, c in self.slow_in_a_row.items() if c >= self.cfg.patience)
        return StragglerReport(step, source, scores, slow, persistent)

    def close(self) -> None:
        if self.detector is not None:
            self.detector.shutdown()
            self.detector = None


def _start_detector(node: str, cuda: bool) -> Any:
    """``Detector.initialize`` with reports gathered on rank 0; without CUDA, CUPTI's manager is
    replaced for the duration of the call (it is only constructed there)."""
    module = straggler_module()
    detector = module.Detector
    if detector.initialized:  # an in-process restart: the previous attempt's detector
        detector.shutdown()
    kwargs = {
        "gather_on_rank0": True,
        "report_time_interval": float("inf"),
        "node_name": node,
        # Every entry is timed on CPU (the section time is the score); CUPTI only every Nth on GPU.
        "profiling_interval": PROFILING_INTERVAL if cuda else 1,
    }
    if cuda:
        detector.initialize(**kwargs)
        return detector
    impl = module.straggler
    cupti, impl.CuptiManager = impl.CuptiManager, _NoKernelTiming
    try:
        detector.initialize(**kwargs)
    finally:
        impl.CuptiManager = cupti
    return detector


def compute_only(kernel_summaries: dict[str, Any]) -> dict[str, Any]:
    """CUPTI's kernel summaries without communication kernels (NCCL's are named ``nccl...``)."""
    return {name: stats for name, stats in kernel_summaries.items() if "nccl" not in name.lower()}


def _generate(detector: Any, cuda: bool) -> Any:
    """``Detector.generate_report``'s steps with NCCL kernels left out (GPU), or without its CUDA
    synchronize and kernels (CPU)."""
    kernels: dict[str, Any] = {}
    if cuda:
        torch.cuda.synchronize()  # every kernel of the sections done, as generate_report does
        kernels = compute_only(detector._get_kernel_summaries())
    report = detector.reporter.generate_report(detector._get_section_summaries(), kernels)
    detector._reset_sections_elapseds()
    if cuda:
        detector.cupti_manager.reset_results()
    return report

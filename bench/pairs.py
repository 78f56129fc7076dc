"""Side-by-side measurement: a product path against its raw baseline, alternating, with spread.

Every ratio in ``make bench`` comes from here. The two paths run in alternating order (raw first on
even repeats, measured first on odd ones), after an untimed warm-up round of each and a ``settle``
step before every run (writes: ``os.sync``, so that no run pays for the writeback of the one
before), so that drifting machine load, page-cache state and writeback hit both alike; each ratio
is reported as the median with the spread (min-max) of the per-repeat ratios. A product path that
beats its raw baseline by more than the baseline's own noise is flagged as a measurement problem:
the raw path is the limit, so beating it means the baseline does not measure the limit (or the two
paths do different work).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class Pair:
    """Seconds of the measured path and of its raw baseline, one entry per repeat."""

    measured: list[float] = field(default_factory=list)
    raw: list[float] = field(default_factory=list)

    def summary(self, kind: Literal["time", "throughput"]) -> dict[str, Any]:
        """``time``: measured / raw seconds (lower is better); ``throughput``: raw / measured seconds."""
        ratios = [m / r if kind == "time" else r / m for m, r in zip(self.measured, self.raw, strict=True)]
        raw_med = statistics.median(self.raw)
        noise = (max(self.raw) - min(self.raw)) / raw_med if len(self.raw) > 1 else 0.0
        ratio = statistics.median(ratios)
        beats = ratio < 1 - noise if kind == "time" else ratio > 1 + noise
        return {
            "kind": kind,
            "repeats": len(ratios),
            "measured_s": round(statistics.median(self.measured), 4),
            "measured_spread_s": [round(min(self.measured), 4), round(max(self.measured), 4)],
            "raw_s": round(raw_med, 4),
            "raw_spread_s": [round(min(self.raw), 4), round(max(self.raw), 4)],
            "ratio": round(ratio, 3),
            "ratio_spread": [round(min(ratios), 3), round(max(ratios), 3)],
            "raw_noise": round(noise, 3),
            "measurement_problem": (
                f"beats its raw baseline by more than the baseline's noise ({noise:.0%}): the baseline is wrong"
                if beats
                else None
            ),
        }


def alternate(
    measured: Callable[[int], float],
    raw: Callable[[int], float],
    repeats: int,
    settle: Callable[[], object] = lambda: None,
    warmup: int = 1,
) -> Pair:
    """Run both paths ``repeats`` times, alternating which goes first, after ``warmup`` untimed
    rounds of each (first-touch allocations, lazily started threads, cold metadata).
    ``settle`` runs before every run, timed or not (e.g. ``os.sync``, so that the writeback one
    run left behind is not charged to the next)."""
    for rep in range(warmup):
        for path in (raw, measured):
            settle()
            path(-1 - rep)
    pair = Pair()
    for rep in range(repeats):
        order = [(raw, pair.raw), (measured, pair.measured)]
        for path, into in order if rep % 2 == 0 else order[::-1]:
            settle()
            into.append(path(rep))
    return pair

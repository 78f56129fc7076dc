"""The soak's fault schedule: which fault, on which rank, how long after the previous recovery.

Pure logic, no I/O. Building blocks:

* :data:`KINDS`: every fault kind the soak injects, each a :class:`Kind` saying what it hits (one
  rank, a node, the whole job) and how the attempt record must name it (``expect``);
* :func:`draw_schedule`: N faults drawn by one seeded generator: the kinds cycle through the
  requested ones in a shuffled order (every kind appears once before any repeats), each fault's rank
  is drawn uniformly, and its gap after the previous recovery is exponential with mean MTTI (a
  Poisson process of interrupts, as Megatron-Core's fault injector and torchft's failure
  controller draw them);
* :func:`check_request`: bad input refused in one line each (an unknown kind, an MTTI shorter than
  a restart, a kind the configuration cannot survive).

``pretrain.soak.inject`` turns a :class:`PlannedFault` into signals and trigger files;
``pretrain.soak.runner`` waits for each recovery before the next gap starts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pretrain.errors import PretrainError


class SoakRequestError(PretrainError):
    """A soak that cannot run as asked (one line with ``fix:``)."""


@dataclass(frozen=True)
class Kind:
    name: str
    target: str  # "rank", "node" or "job": what the fault hits
    expect: str  # the class the attempt record must give it (see pretrain.soak.report.recorded_class)
    help: str


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind("kill-rank", "rank", "killed", "SIGKILL of one rank"),
        Kind("kill-node", "node", "killed", "SIGKILL of every rank of one node"),
        Kind("kill-job", "job", "killed", "SIGKILL of the launcher and every rank, then the job started again"),
        Kind("sigstop", "rank", "hang", "SIGSTOP of one rank, never continued"),
        Kind("sigsegv", "rank", "signal-11", "SIGSEGV of one rank"),
        Kind("exception", "rank", "exception", "an exception raised inside one rank"),
        Kind("gil", "rank", "hang", "a thread in one rank holds the GIL forever"),
        Kind("corrupt-kill", "rank", "killed", "a byte flipped in the rank's newest committed step, then SIGKILL"),
        Kind("sigterm", "job", "preempted", "SIGTERM to the launcher (a preemption), then the job started again"),
    )
}


@dataclass(frozen=True)
class PlannedFault:
    index: int
    kind: str
    rank: int  # the rank hit (for a node: a rank on that node; for the job: 0)
    gap_s: float  # seconds after the previous fault's recovery


@dataclass(frozen=True)
class Survivability:
    """What the configuration can survive, read from it by the caller."""

    replicated: bool  # tier-1 steps have a copy on another node (checkpoint.replication.factor >= 2)
    restart_s: float  # how long a restart takes (launcher detection + start-up + restore), estimated


def parse_kinds(spec: str | None) -> list[str]:
    """``"kill-rank,sigstop"`` -> names; None or "all" -> every kind. Raises SoakRequestError."""
    if spec is None or spec.strip() in ("", "all"):
        return list(KINDS)
    names = [k.strip() for k in spec.split(",") if k.strip()]
    for name in names:
        if name not in KINDS:
            raise SoakRequestError(
                f"soak: --kinds: unknown kind {name!r}; fix: use some of {', '.join(KINDS)} (comma separated)"
            )
    return list(dict.fromkeys(names))


def check_request(kinds: list[str], faults: int, mtti_s: float, can: Survivability) -> None:
    """Refuse a soak that cannot mean what it says (one line each, ``fix:`` included)."""
    if faults < 1:
        raise SoakRequestError(f"soak: --faults {faults}: at least one fault; fix: pass --faults 1 or more")
    if mtti_s < can.restart_s:
        raise SoakRequestError(
            f"soak: --mtti {mtti_s:g}s is shorter than a restart (~{can.restart_s:g}s): faults would arrive faster "
            f"than recovery; fix: pass --mtti {can.restart_s:g} or more"
        )
    if not can.replicated:
        lost = [k for k in kinds if KINDS[k].target in ("node", "job")]
        if lost:
            raise SoakRequestError(
                f"soak: kinds {', '.join(lost)} lose a node, and this configuration cannot survive that "
                "(checkpoint.replication.factor < 2: no copy of a node's tier-1 steps elsewhere); fix: set "
                "checkpoint.replication.factor: 2 or leave those kinds out of --kinds"
            )


def draw_schedule(kinds: list[str], faults: int, mtti_s: float, ranks: int, seed: int) -> list[PlannedFault]:
    """``faults`` faults from one generator seeded with ``seed``: the same arguments, the same schedule."""
    rng = random.Random(seed)
    order: list[str] = []
    while len(order) < faults:
        batch = list(kinds)
        rng.shuffle(batch)  # every kind once per round: a short soak still covers every kind
        order += batch
    out = []
    for i, kind in enumerate(order[:faults]):
        rank = 0 if KINDS[kind].target == "job" else rng.randrange(ranks)
        out.append(PlannedFault(index=i, kind=kind, rank=rank, gap_s=round(rng.expovariate(1.0 / mtti_s), 3)))
    return out

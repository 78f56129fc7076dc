"""The soak's fault schedule: which fault, on which rank, how long after the previous recovery.

Pure logic, no I/O. Building blocks:

* :data:`KINDS`: every fault kind the soak injects, each a :class:`Kind` saying what it hits (one
  rank, a node, the whole job, tier 1's storage, or the object store) and how the records must
  name it (``expect``: the attempt record's class; for a storage kind the ``reason`` of the failed
  tier-1 save, for the store kind the ``reason`` label of the uploader's failure counter, since the
  job does not stop for either);
* :func:`draw_schedule`: N faults drawn by one seeded generator: the kinds cycle through the
  requested ones in a shuffled order (every kind appears once before any repeats), each fault's rank
  is drawn uniformly, and its gap after the previous recovery is exponential with mean MTTI (a
  Poisson process of interrupts, as Megatron-Core's fault injector and torchft's failure
  controller draw them), in seconds, or in steps trained (``--mtti-steps``: where each fault lands
  then does not depend on how fast the machine trains, which a short CI soak needs);
* :func:`check_request`, :func:`check_fits`: bad input refused in one line each (an unknown kind,
  an MTTI shorter than a restart, a kind the configuration cannot survive or this machine cannot
  inject, a store kind without an object store reached over the network, faults paced by steps
  that cannot all land before the run's last step).

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
    target: str  # "rank", "node", "job", "storage" (tier 1's file system) or "store" (tier 3's): what it hits
    expect: str  # the class the attempt record must give it (see pretrain.soak.report.recorded_class)
    help: str

    @property
    def restarts(self) -> bool:
        """Does the job restart for it? Not for tier 1's storage or the object store: it trains on."""
        return self.target not in ("storage", "store")


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
        Kind(
            "blocked-write",
            "storage",
            "stalled",
            "tier 1's writes block in the kernel (a FUSE mount's gate closed) until the job records the stall",
        ),
        Kind("full-disk", "storage", "disk_full", "tier 1's tmpfs filled from outside until a save fails, then freed"),
        Kind(
            "s3-unreachable",
            "store",
            "store",
            "the object store stops answering (a proxy black-holes the uploader's connections) until the uploader "
            "records failures, then answers again",
        ),
    )
}
STORAGE_KINDS = [k.name for k in KINDS.values() if k.target == "storage"]
STORE_KINDS = [k.name for k in KINDS.values() if k.target == "store"]


# Steps a job may train between the moment a fault is due and the moment it acts: the runner polls
# the records every 50 ms, and an in-rank fault fires at the start of the rank's next step.
INJECTION_LATENCY_STEPS = 3


@dataclass(frozen=True)
class PlannedFault:
    index: int
    kind: str
    rank: int  # the rank hit (for a node: a rank on that node; for the job: 0)
    gap_s: float  # seconds after the previous fault's recovery
    gap_steps: int | None = None  # paced by steps instead: steps trained after the previous recovery


@dataclass(frozen=True)
class Survivability:
    """What the configuration can survive, read from it by the caller."""

    replicated: bool  # tier-1 steps have a copy on another node (checkpoint.replication.factor >= 2)
    restart_s: float  # how long a restart takes (launcher detection + start-up + restore), estimated
    background_saves: bool = True  # checkpoint.async.enabled: only a background save has a stall deadline
    writer_process: bool = True  # the tier-1 writer is a process (async.mode auto/fork on CPU), not a thread
    cannot_mount: str | None = None  # why tier 1 cannot be put on a gated FUSE mount over a tmpfs here
    s3_uri: str | None = None  # checkpoint.s3.uri: the object store the uploader promotes to
    s3_endpoint: str | None = None  # checkpoint.s3.endpoint_url: where the soak's proxy forwards to


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


def check_request(
    kinds: list[str], faults: int, mtti_s: float, can: Survivability, mtti_steps: float | None = None
) -> None:
    """Refuse a soak that cannot mean what it says (one line each, ``fix:`` included)."""
    if faults < 1:
        raise SoakRequestError(f"soak: --faults {faults}: at least one fault; fix: pass --faults 1 or more")
    if mtti_steps is not None and mtti_steps < 1:
        raise SoakRequestError(
            f"soak: --mtti-steps {mtti_steps:g}: faults are paced by whole steps; fix: pass --mtti-steps 1 or more"
        )
    if mtti_steps is None and mtti_s < can.restart_s:
        raise SoakRequestError(
            f"soak: --mtti {mtti_s:g}s is shorter than a restart (~{can.restart_s:g}s): faults would arrive faster "
            f"than recovery; fix: pass --mtti {can.restart_s:g} or more"
        )
    _check_storage_kinds(kinds, can)
    _check_store_kinds(kinds, can)
    if not can.replicated:
        lost = [k for k in kinds if KINDS[k].target in ("node", "job")]
        if lost:
            raise SoakRequestError(
                f"soak: kinds {', '.join(lost)} lose a node, and this configuration cannot survive that "
                "(checkpoint.replication.factor < 2: no copy of a node's tier-1 steps elsewhere); fix: set "
                "checkpoint.replication.factor: 2 or leave those kinds out of --kinds"
            )


def _check_storage_kinds(kinds: list[str], can: Survivability) -> None:
    storage = [k for k in kinds if k in STORAGE_KINDS]
    if not storage:
        return
    named = ", ".join(storage)
    if can.cannot_mount is not None:
        raise SoakRequestError(
            f"soak: kinds {named} put tier 1 on a gated FUSE mount over a small tmpfs, which cannot be made here "
            f"({can.cannot_mount}); fix: run the soak as root with /dev/fuse and fusepy, or leave those kinds out "
            "of --kinds"
        )
    if "blocked-write" in storage and not can.background_saves:
        raise SoakRequestError(
            "soak: kind blocked-write cannot be survived with checkpoint.async.enabled: false (a synchronous "
            "tier-1 save has no stall deadline: training would wait in the kernel); fix: set "
            "checkpoint.async.enabled: true or leave blocked-write out of --kinds"
        )
    if "blocked-write" in storage and not can.writer_process:
        raise SoakRequestError(
            "soak: kind blocked-write cannot be survived with a thread tier-1 writer (checkpoint.async.mode: thread: "
            "a thread stuck in a stalled write keeps its rank from exiting at the next fault); fix: set "
            "checkpoint.async.mode: auto or fork, or leave blocked-write out of --kinds"
        )


def _check_store_kinds(kinds: list[str], can: Survivability) -> None:
    store = [k for k in kinds if k in STORE_KINDS]
    if not store:
        return
    named = ", ".join(store)
    sets = "--set checkpoint.s3.uri=s3://BUCKET/PREFIX --set checkpoint.s3.endpoint_url=http://HOST:PORT"
    if not can.s3_uri:
        raise SoakRequestError(
            f"soak: kind {named} cuts the uploader off the object store, and checkpoint.s3.uri is not set (no "
            f"uploader, no store); fix: pass {sets} (make soak starts a Ceph RGW), or leave {named} out of --kinds"
        )
    if can.s3_uri.startswith("file://"):
        raise SoakRequestError(
            f"soak: kind {named} cuts the network to the object store, and checkpoint.s3.uri {can.s3_uri} is a "
            f"directory (no network to cut); fix: pass {sets}, or leave {named} out of --kinds"
        )
    if not can.s3_endpoint:
        raise SoakRequestError(
            f"soak: kind {named} puts a proxy in front of checkpoint.s3.endpoint_url, which is not set (the "
            f"provider's default endpoint); fix: pass --set checkpoint.s3.endpoint_url=http://HOST:PORT (an "
            f"S3-compatible store you may cut, e.g. a local Ceph RGW), or leave {named} out of --kinds"
        )


def check_fits(schedule: list[PlannedFault], steps: int, margin: int) -> None:
    """Faults paced by steps must all land before the run ends: each lands at most ``gap_steps``
    plus a few steps (its injection's latency) after the previous one, and none in the last
    ``margin`` steps. Refuses a run too short for its schedule, naming the steps it needs."""
    paced = [p.gap_steps for p in schedule if p.gap_steps is not None]
    need = sum(g + INJECTION_LATENCY_STEPS for g in paced) + margin + 1
    if paced and steps < need:
        raise SoakRequestError(
            f"soak: --steps {steps} is too short for {len(paced)} faults paced by steps (they may need up to "
            f"step {need} to land); fix: pass --steps {need} or more, or a smaller --mtti-steps"
        )


def draw_schedule(
    kinds: list[str], faults: int, mtti: float, ranks: int, seed: int, in_steps: bool = False
) -> list[PlannedFault]:
    """``faults`` faults from one generator seeded with ``seed``: the same arguments, the same
    schedule. ``in_steps``: ``mtti`` is a mean number of steps, each gap a whole number of them (>= 1)."""
    rng = random.Random(seed)
    order: list[str] = []
    while len(order) < faults:
        batch = list(kinds)
        rng.shuffle(batch)  # every kind once per round: a short soak still covers every kind
        order += batch
    out = []
    for i, kind in enumerate(order[:faults]):
        rank = 0 if KINDS[kind].target == "job" else rng.randrange(ranks)
        gap = rng.expovariate(1.0 / mtti)
        if in_steps:
            out.append(PlannedFault(index=i, kind=kind, rank=rank, gap_s=0.0, gap_steps=max(1, round(gap))))
        else:
            out.append(PlannedFault(index=i, kind=kind, rank=rank, gap_s=round(gap, 3)))
    return out

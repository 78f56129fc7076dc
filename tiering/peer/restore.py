"""Recovery from tiers 1-2: own local copy first, then a peer's replica.

Collective. The lowest rank on each node scans that node's local root (primaries and replicas,
whoever wrote them) and reports which owner ranks' steps it can serve. The newest step that every
owner rank can obtain is chosen; each owner reads a copy on its own node when there is one, else
the serving rank of a node that holds one verifies it and sends it. Copies that fail verification
are quarantined and the plan is redone; copies saved at another topology are not loadable here
and are reported, so that the caller falls back to the reshardable tier.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiering.collective import Collective
from tiering.errors import PublishError, VerificationError
from tiering.layout import parse_step_name
from tiering.local.posix import PosixTier, primary_store, replica_store
from tiering.local.publish import publish_received
from tiering.peer.transport import OutgoingStep, Transport
from tiering.verify import read_manifest

log = logging.getLogger(__name__)

# (kind, owner): kind is "primary" (ranks/) or "replica" (replicas/)
StoreKey = tuple[str, int]
# (owner, (node, kind) of the copy, one-line reason): a copy that failed verification
CopyFailure = tuple[int, tuple[str, str], str]


@dataclass
class PeerRestore:
    step: int
    path: Path  # where this rank's verified copy now is, on its own node
    tier: str  # "local": own primary; "peer": a replica (from this node or sent by a peer)
    source: str  # e.g. "node-a:replica" for the log
    seconds: float


@dataclass
class PeerPlanResult:
    restore: PeerRestore | None
    skipped_topology: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)


class PeerRecovery:
    def __init__(
        self,
        run_id: str,
        rank: int,
        world: int,
        node: str,
        node_root: Path,
        coll: Collective,
        transport: Transport,
        topology: dict[str, int],
        keep: int,
        attempt: str,
        on_phase: Callable[[str], None] = lambda phase: None,
    ) -> None:
        # Told "verify" and "transfer" as this rank enters them (the caller's progress record).
        self.on_phase = on_phase
        self.run_id = run_id
        self.rank = rank
        self.world = world
        self.node = node
        self.node_root = node_root
        self.coll = coll
        self.transport = transport
        self.topology = topology
        self.keep = keep
        self.attempt = attempt

    def _store(self, key: StoreKey) -> PosixTier:
        kind, owner = key
        make = primary_store if kind == "primary" else replica_store
        return make(self.node_root, owner, self.run_id, self.keep)

    def _scan(self) -> tuple[dict[str, list[int]], list[str], list[str]]:
        """{"kind:owner": [steps]} with readable manifests at this topology; plus topology skips and
        rejected step directories (no readable manifest or no COMMITTED marker: quarantined)."""
        found: dict[str, list[int]] = {}
        skipped: list[str] = []
        rejected: list[str] = []
        for kind, sub in (("primary", "ranks"), ("replica", "replicas")):
            base = self.node_root / sub
            if not base.is_dir():
                continue
            for owner_dir in sorted(base.iterdir()):
                if not owner_dir.name.startswith("rank-") or not owner_dir.name[5:].isdigit():
                    continue
                owner = int(owner_dir.name[5:])
                store = self._store((kind, owner))
                steps = []
                for step in store.step_dirs():
                    try:
                        manifest = read_manifest(store.step_path(step))
                    except VerificationError as exc:
                        # An interrupted publish or a damaged copy: out of the way, with the reason.
                        rejected.append(str(exc))
                        store.quarantine(step, str(exc))
                        continue
                    want = {k: v for k, v in self.topology.items() if k != "world_size"}
                    if manifest.world_size != self.topology["world_size"] or manifest.parallelism != want:
                        skipped.append(
                            f"{store.step_path(step)} (saved at world {manifest.world_size} "
                            f"{manifest.parallelism}, now world {self.topology['world_size']} {want})"
                        )
                        continue
                    if owner < self.world:
                        steps.append(step)
                if steps:
                    found[f"{kind}:{owner}"] = steps
        return found, skipped, rejected

    def recover(self) -> PeerPlanResult:
        t0 = time.perf_counter()
        nodes: list[str] = self.coll.all_gather(self.node)
        serving = {n: min(r for r, m in enumerate(nodes) if m == n) for n in set(nodes)}
        mine = self._scan() if serving[self.node] == self.rank else ({}, [], [])
        # One gather of the three lists (each gather is a round trip of every rank, on the RTO path).
        gathered: list[tuple[dict[str, list[int]], list[str], list[str]]] = self.coll.all_gather(mine)
        scans = [scan for scan, _, _ in gathered]
        result = PeerPlanResult(None, [s for _, skipped, _ in gathered for s in skipped])
        result.rejected.extend(r for _, _, rejected in gathered for r in rejected)
        # availability[step][owner] -> list of (node, kind)
        avail: dict[int, dict[int, list[tuple[str, str]]]] = {}
        for r, found in enumerate(scans):
            for key, steps in found.items():
                kind, owner = key.split(":")
                for step in steps:
                    avail.setdefault(step, {}).setdefault(int(owner), []).append((nodes[r], kind))
        for step in sorted(avail, reverse=True):
            restore = self._try_step(step, avail[step], nodes, serving, result, t0)
            if restore is not None:
                result.restore = restore
                return result
        return result

    def _choose(self, copies: dict[int, list[tuple[str, str]]], nodes: list[str]) -> dict[int, tuple[str, str]] | None:
        plan = {}
        for owner in range(self.world):
            options = copies.get(owner, [])
            if not options:
                return None
            here = nodes[owner]
            # Own node first (primary before replica), then other nodes (primary first, then name).
            options = sorted(options, key=lambda c: (c[0] != here, c[1] != "primary", c[0]))
            plan[owner] = options[0]
        return plan

    def _try_step(
        self,
        step: int,
        copies: dict[int, list[tuple[str, str]]],
        nodes: list[str],
        serving: dict[str, int],
        result: PeerPlanResult,
        t0: float,
    ) -> PeerRestore | None:
        copies = {o: list(c) for o, c in copies.items()}
        while True:
            plan = self._choose(copies, nodes)
            if plan is None:
                return None
            failures, outgoing = self._prepare(step, plan, nodes, serving)
            if not failures:
                restore, failures = self._execute(step, plan, outgoing, nodes, result, serving, t0)
                if not failures:
                    return restore
            for owner, copy, reason in failures:
                copies[owner] = [c for c in copies[owner] if tuple(c) != tuple(copy)]
                result.rejected.append(reason)
                if self.rank == 0:
                    log.error("tier 1-2 copy rejected: %s", reason)

    def _prepare(
        self, step: int, plan: dict[int, tuple[str, str]], nodes: list[str], serving: dict[str, int]
    ) -> tuple[list[CopyFailure], dict[int, OutgoingStep]]:
        """Collective. The owner verifies a copy on its own node (the load then maps the verified
        pages); the serving rank of another node checks the structure of a copy it will send (its
        chunks are checked while it is read for sending). Every rank's failures, gathered."""
        failures: list[CopyFailure] = []
        outgoing: dict[int, OutgoingStep] = {}
        for owner, (node, kind) in plan.items():
            verifier = owner if node == nodes[owner] else serving[node]
            if verifier != self.rank:
                continue
            self.on_phase("verify")
            store = self._store((kind, owner))
            try:
                if verifier == owner:
                    store.verify(step)
                else:
                    header = {"run_id": self.run_id, "step": step, "owner": owner, "kind": "restore"}
                    outgoing[owner] = OutgoingStep.of(store.step_path(step), header, check=True)
            except VerificationError as exc:
                failures.append((owner, (node, kind), str(exc)))
                store.quarantine(step, str(exc))
        return [f for part in self.coll.all_gather(failures) for f in part], outgoing

    def _execute(
        self,
        step: int,
        plan: dict[int, tuple[str, str]],
        outgoing: dict[int, OutgoingStep],
        nodes: list[str],
        result: PeerPlanResult,
        serving: dict[str, int],
        t0: float,
    ) -> tuple[PeerRestore | None, list[CopyFailure]]:
        """Collective. Stream the copies this rank serves (checked while read), receive this
        rank's copy if it is on another node (checked as it arrives) and publish it as this rank's
        own. A served copy that did not match is quarantined and reported, so that the plan is
        redone without it; any other failure ends this step's attempt (None)."""
        node, kind = plan[self.rank]
        mine = primary_store(self.node_root, self.rank, self.run_id, self.keep)
        into = {serving[node]: mine.layout.tmp_dir(step, self.attempt)} if node != self.node else {}
        if outgoing or into:
            self.on_phase("transfer")
        received, errors = self.transport.exchange(dict(outgoing), into)
        bad_sent: list[CopyFailure] = []
        for owner, payload in outgoing.items():
            if payload.failure is not None:
                bad_sent.append((owner, plan[owner], payload.failure))
                self._store((plan[owner][1], owner)).quarantine(step, payload.failure)
        error, path = None, self._store((kind, self.rank)).step_path(step)
        for src in into:
            got = received.get(src)
            if got is None:
                why = errors.get(src, "nothing sent")
                error = f"rank {self.rank}: fetching step {step} from rank {src} failed: {why}"
                continue
            try:
                # A restore copy: not fsynced, the peer's copy stays (see publish_dir).
                publish_received(mine.layout, got, self.run_id, step, self.rank, durable=False)
                path = mine.step_path(step)
            except (VerificationError, PublishError, OSError) as exc:
                error = f"rank {self.rank}: copy of step {step} from rank {src} rejected: {exc}"
        gathered = self.coll.all_gather((error, bad_sent))
        sent_failures = [f for _, part in gathered for f in part]
        errors_all = [e for e, _ in gathered if e]
        if sent_failures:
            return None, sent_failures  # a served copy was bad: the plan is redone without it
        if errors_all:
            result.rejected.extend(errors_all)
            if self.rank == 0:
                log.error("tier 1-2 restore of step %d failed: %s", step, errors_all[0])
            return None, []
        own = kind == "primary" and node == self.node
        source = f"{node}:{kind}" + ("" if node == self.node else f" via rank {serving[node]}")
        return PeerRestore(step, path, "local" if own else "peer", source, time.perf_counter() - t0), []


def owner_of(path: Path) -> int | None:
    """rank-00003 -> 3 for a ``ranks/`` or ``replicas/`` directory."""
    name = path.name
    return int(name[5:]) if name.startswith("rank-") and name[5:].isdigit() else None


def scan_node_root(node_root: Path, run_id: str) -> dict[str, Any]:
    """For ``tiering ls``: per step, which owners have primaries/replicas here and whether they verify."""
    out: dict[int, dict[str, dict[int, str]]] = {}
    for kind, sub in (("primary", "ranks"), ("replica", "replicas")):
        base = node_root / sub
        if not base.is_dir():
            continue
        for owner_dir in sorted(base.iterdir()):
            owner = owner_of(owner_dir)
            if owner is None or not (owner_dir / "steps").is_dir():
                continue
            store = PosixTier(base, owner_dir.name, run_id=run_id)
            for step_dir in (owner_dir / "steps").iterdir():
                step = parse_step_name(step_dir.name)
                if step is None:
                    continue
                try:
                    store.verify(step)
                    status = "ok"
                except VerificationError as exc:
                    status = f"BAD: {exc}"
                out.setdefault(step, {}).setdefault(kind, {})[owner] = status
    return out

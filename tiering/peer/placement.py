"""Failure domains and replica placement, computed deterministically from the rank -> domain map.

Owns: the level a job's failure domains are taken at (a label chain from ``pretrain node-domain``
falls back to the next label, then the node), and which ranks hold each rank's replicas (balanced:
no node holds more than ``ceil(replicas / nodes)``). Pure logic and logging, no I/O beyond the
environment read by :func:`node_name`/:func:`failure_domain`. Called by the trainer's per-rank tier
(``pretrain/checkpointing/per_rank_assembly.py``) once every rank's identity is gathered.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)


class PlacementError(ValueError):
    """Replicas cannot be placed in distinct failure domains; one line naming the domains."""


@dataclass(frozen=True)
class RankIdentity:
    rank: int
    node: str
    domain: str


def node_name(configured: str | None = None) -> str:
    """This rank's node: config, then ``NODE_NAME`` (Kubernetes), ``SLURMD_NODENAME``, the hostname."""
    return configured or os.environ.get("NODE_NAME") or os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def failure_domain(node: str, domains: Mapping[str, str]) -> str:
    """The node's failure domain: the config map, then ``FAILURE_DOMAIN``, else the node itself."""
    return domains.get(node) or os.environ.get("FAILURE_DOMAIN") or node


def _describe(identities: list[RankIdentity]) -> str:
    by_domain: dict[str, list[int]] = {}
    for ident in identities:
        by_domain.setdefault(ident.domain, []).append(ident.rank)
    return ", ".join(f"{d}: ranks {','.join(map(str, sorted(r)))}" for d, r in sorted(by_domain.items()))


def domain_levels(domain: str) -> list[tuple[str, str]]:
    """A failure domain as (level, value) pairs, the preferred level first.

    ``pretrain node-domain`` writes every configured node label the node carries, then the node
    itself: ``topology.k8s.aws/network-node-layer-3=nn-1,...-layer-2=nn-2,kubernetes.io/hostname=ip-1``.
    A plain name (``FAILURE_DOMAIN=rack-a``, a Slurm topology file) is one level of its own.
    """
    if "=" not in domain:
        return [("domain", domain)]
    return [(level, value) for level, _, value in (part.partition("=") for part in domain.split(",") if part)]


def resolve_domains(identities: list[RankIdentity], factor: int) -> tuple[list[RankIdentity], str | None]:
    """Every rank's domain at one level: the first level (in the order the nodes list them) that
    every rank carries and that splits the job into at least ``factor`` domains; else the node.

    A job inside one placement group (one ``network-node-layer-3`` value) or on nodes without the
    label thus falls back to the next level, then to the node, and says so in one line (returned).
    Plain domains are returned unchanged (their single level is the whole truth).
    """
    chains = {i.rank: dict(domain_levels(i.domain)) for i in identities}
    if all(list(c) == ["domain"] for c in chains.values()):
        return identities, None
    levels: list[str] = []
    for ident in identities:
        levels += [lv for lv in chains[ident.rank] if lv not in levels]
    skipped = []
    for level in levels:
        lacking = sorted({i.node for i in identities if level not in chains[i.rank]})
        values = {chains[i.rank].get(level) for i in identities}
        if not lacking and len(values) >= factor:
            chosen = [RankIdentity(i.rank, i.node, chains[i.rank][level]) for i in identities]
            return chosen, (f"failure domains: {'; '.join(skipped)}; using {level}" if skipped else None)
        nodes = len({i.node for i in identities})
        skipped.append(
            f"node(s) {','.join(lacking[:3])}{',...' if len(lacking) > 3 else ''} lack {level}"
            if lacking
            else f"all {nodes} node(s) share {level}={values.pop()}"
            if len(values) == 1
            else f"{level} has {len(values)} value(s) for {factor} copies"
        )
    chosen = [RankIdentity(i.rank, i.node, i.node) for i in identities]
    return chosen, f"failure domains: {'; '.join(skipped)}; falling back to the node as the failure domain"


def _copies(order: list[RankIdentity], shift: int, factor: int, i: int) -> list[RankIdentity]:
    return [order[(i + k * shift) % len(order)] for k in range(factor)]


def _cost(order: list[RankIdentity], shift: int, factor: int) -> tuple[int, int]:
    """(owners whose copies share a node, copies that share a domain with another of the owner's)."""
    nodes = domains = 0
    for i in range(len(order)):
        copies = _copies(order, shift, factor, i)
        nodes += len({c.node for c in copies}) < factor or len({c.rank for c in copies}) < factor
        domains += factor - len({c.domain for c in copies})
    return nodes, domains


def _balanced(identities: list[RankIdentity], factor: int) -> dict[int, list[int]]:
    """The k-th replica of the rank at position i (ranks sorted by domain, node, rank) goes to the
    rank at position ``i + k * shift``: every shift is a permutation, so every rank holds exactly
    ``factor - 1`` replicas and a node ``factor - 1`` per rank it runs, ``ceil(replicas / nodes)``
    with the same ranks per node, however uneven the domains. The shift (whole nodes where the
    nodes are alike) is the one that keeps each owner's copies on distinct nodes and puts the most
    of them in distinct domains; what uneven domains make impossible is said in one line."""
    order = sorted(identities, key=lambda i: (i.domain, i.node, i.rank))
    per_node: dict[str, int] = {}
    for ident in identities:
        per_node[ident.node] = per_node.get(ident.node, 0) + 1
    unit = next(iter(per_node.values())) if len(set(per_node.values())) == 1 else 1
    shifts = [t * unit for t in range(1, len(order) // unit)] or list(range(1, len(order)))
    best, best_cost = shifts[0], _cost(order, shifts[0], factor)
    for shift in shifts[1:]:
        if best_cost == (0, 0):
            break
        cost = _cost(order, shift, factor)
        if cost < best_cost:
            best, best_cost = shift, cost
    if best_cost != (0, 0):
        log.warning(
            "uneven failure domains (%s): %d replica(s) share a domain with another copy of their owner "
            "(%d owner(s) with copies on one node) so that no node holds more than %d replica(s)",
            ", ".join(f"{d}: {n} node(s)" for d, n in sorted(_nodes_per_domain(identities).items())),
            best_cost[1],
            best_cost[0],
            max(per_node.values()) * (factor - 1),
        )
    return {order[i].rank: [c.rank for c in _copies(order, best, factor, i)[1:]] for i in range(len(order))}


def _nodes_per_domain(identities: list[RankIdentity]) -> dict[str, int]:
    nodes: dict[str, set[str]] = {}
    for ident in identities:
        nodes.setdefault(ident.domain, set()).add(ident.node)
    return {d: len(n) for d, n in nodes.items()}


def replica_holders(identities: list[RankIdentity], factor: int, allow_same_domain: bool) -> dict[int, list[int]]:
    """owner rank -> the ``factor - 1`` ranks that hold its replicas.

    Domains are first resolved to one level (:func:`resolve_domains`). With at least ``factor``
    domains the placement is balanced (:func:`_balanced`): no node holds more than
    ``ceil(replicas / nodes)`` copies, and each owner's copies sit in distinct domains wherever the
    domains' sizes allow it (else on distinct nodes, said in one line). Fewer domains are an error
    unless ``allow_same_domain`` (then replicas go to the next ranks on other nodes where possible,
    with a warning).
    """
    world = len(identities)
    if factor <= 1:
        return {i.rank: [] for i in identities}
    if world < factor and allow_same_domain:
        log.warning(
            "checkpoint.replication.factor=%d but the job has %d rank(s): no replicas (development only)", factor, world
        )
        return {i.rank: [] for i in identities}
    if world < factor:
        raise PlacementError(
            f"checkpoint.replication.factor={factor} needs at least {factor} ranks, the job has {world}; "
            "fix: lower the factor or add ranks"
        )
    identities, note = resolve_domains(identities, factor)
    if note:
        log.warning("%s", note)
    names = {i.domain for i in identities}
    if len(names) >= factor:
        return _balanced(identities, factor)
    if not allow_same_domain:
        raise PlacementError(
            f"checkpoint.replication.factor={factor} needs {factor} failure domains, found {len(names)} "
            f"({_describe(identities)}); fix: map hosts to domains in checkpoint.replication.domains or set "
            "FAILURE_DOMAIN per node, or set checkpoint.replication.allow_same_domain: true for single-node development"
        )
    log.warning(
        "checkpoint.replication.allow_same_domain: replicas share a failure domain (%s); a domain failure can "
        "lose a step. Use this for single-node development only.",
        _describe(identities),
    )
    return _next_nodes(identities, factor)


def _next_nodes(identities: list[RankIdentity], factor: int) -> dict[int, list[int]]:
    """Same-domain development placement: the next ranks, striding by the ranks per node."""
    world = len(identities)
    order = sorted(identities, key=lambda i: (i.node, i.rank))
    index = {ident.rank: n for n, ident in enumerate(order)}
    # Stride by the ranks per node so that, where there are several nodes, replicas land on another one.
    stride = max(1, world // max(1, len({i.node for i in identities})))
    out = {}
    for ident in identities:
        chosen: list[int] = []
        step = stride
        while len(chosen) < factor - 1:
            cand = order[(index[ident.rank] + step) % world].rank
            if cand != ident.rank and cand not in chosen:
                chosen.append(cand)
            step += 1
        out[ident.rank] = chosen
    return out

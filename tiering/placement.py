"""Failure domains and replica placement, computed deterministically from the rank -> domain map."""

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


def replica_holders(identities: list[RankIdentity], factor: int, allow_same_domain: bool) -> dict[int, list[int]]:
    """owner rank -> the ``factor - 1`` ranks that hold its replicas.

    With enough domains, each owner's copies (its own plus the replicas) sit in ``factor``
    distinct domains: the k-th replica goes to the k-th next domain (sorted by name), to the rank
    at the owner's position within its own domain, modulo the size of the target domain, which
    spreads the load evenly. Otherwise it is an error unless ``allow_same_domain`` (then replicas
    go to the next ranks on other nodes where possible, with a warning).
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
    domains: dict[str, list[int]] = {}
    for ident in sorted(identities, key=lambda i: i.rank):
        domains.setdefault(ident.domain, []).append(ident.rank)
    names = sorted(domains)
    if len(names) >= factor:
        holders: dict[int, list[int]] = {}
        for d_index, name in enumerate(names):
            for position, owner in enumerate(domains[name]):
                targets = []
                for k in range(1, factor):
                    members = domains[names[(d_index + k) % len(names)]]
                    targets.append(members[position % len(members)])
                holders[owner] = targets
        return holders
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

"""Replica placement on the failure-domain layouts real clusters have: uneven switch domains (3+1,
5+2+1, 12+1+1 nodes of 8 ranks), a job under one layer-3 switch, a node without the label. The
bound: no node holds more than ``ceil(replicas / nodes)`` copies (tier 0 and tier 1 are sized for
it); every owner's copies on distinct nodes; as many in distinct domains as the sizes allow."""

from __future__ import annotations

import logging
import math
from collections import Counter

import pytest

from tiering.peer.placement import RankIdentity, domain_levels, replica_holders, resolve_domains

L3, L2, HOST = (
    "topology.k8s.aws/network-node-layer-3",
    "topology.k8s.aws/network-node-layer-2",
    "kubernetes.io/hostname",
)


def _layout(nodes_per_domain: list[int], ranks_per_node: int = 8) -> list[RankIdentity]:
    ids, rank = [], 0
    for d, count in enumerate(nodes_per_domain):
        for n in range(count):
            for _ in range(ranks_per_node):
                ids.append(RankIdentity(rank, f"d{d}-node{n}", f"switch-{d}"))
                rank += 1
    return ids


def _check(ids: list[RankIdentity], holders: dict[int, list[int]], factor: int) -> tuple[int, int]:
    """(max copies on a node, copies sharing a domain with another copy of their owner)."""
    node = {i.rank: i.node for i in ids}
    domain = {i.rank: i.domain for i in ids}
    assert sorted(holders) == sorted(node) and all(len(h) == factor - 1 for h in holders.values())
    for owner, hs in holders.items():
        assert len({node[owner], *(node[h] for h in hs)}) == factor, f"rank {owner}'s copies share a node"
    load = Counter(node[h] for hs in holders.values() for h in hs)
    shared = sum(factor - len({domain[o], *(domain[h] for h in hs)}) for o, hs in holders.items())
    return max(load.values()), shared


@pytest.mark.parametrize(
    ("layout", "factor", "least_shared"),
    [
        ([3, 1], 2, 16),  # 24 owners in switch 0, 8 places outside it: 16 must stay (on other nodes)
        ([5, 2, 1], 2, 16),  # 40 owners in switch 0, 24 places outside
        ([12, 1, 1], 2, 80),
        ([5, 2, 1], 3, None),
        ([2, 2], 2, 0),
        ([1, 1, 1], 3, 0),
    ],
)
def test_uneven_domains_never_overload_a_node(layout: list[int], factor: int, least_shared: int | None) -> None:
    ids = _layout(layout)
    holders = replica_holders(ids, factor, allow_same_domain=False)
    most, shared = _check(ids, holders, factor)
    replicas, nodes = len(ids) * (factor - 1), sum(layout)
    assert most <= math.ceil(replicas / nodes), f"a node holds {most} copies (before: 24 on the 3+1 layout's one)"
    if least_shared is not None:
        assert shared == least_shared, "as many copies in other domains as the domain sizes allow"
    assert holders == replica_holders(list(reversed(ids)), factor, False), "placement is deterministic"


def _chains(l3_of_node: dict[str, str | None], ranks_per_node: int = 2) -> list[RankIdentity]:
    ids = []
    for n, (node, l3) in enumerate(sorted(l3_of_node.items())):
        chain = ([f"{L3}={l3}"] if l3 else []) + [f"{L2}=spine-1", f"{HOST}={node}"]
        ids += [RankIdentity(n * ranks_per_node + k, node, ",".join(chain)) for k in range(ranks_per_node)]
    return ids


def test_a_job_under_one_switch_falls_back_to_the_node_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    ids = _chains({"ip-1": "nn-a", "ip-2": "nn-a", "ip-3": "nn-a", "ip-4": "nn-a"})
    resolved, note = resolve_domains(ids, 2)
    assert [i.domain for i in resolved] == [i.node for i in ids]
    assert note == (f"failure domains: all 4 node(s) share {L3}=nn-a; all 4 node(s) share {L2}=spine-1; using {HOST}")
    with caplog.at_level(logging.WARNING, logger="tiering.peer.placement"):
        holders = replica_holders(ids, 2, allow_same_domain=False)  # not refused
    assert [r.getMessage() for r in caplog.records] == [note]
    assert _check(resolved, holders, 2) == (2, 0)


def test_the_first_level_that_splits_the_job_is_used() -> None:
    ids = _chains({"ip-1": "nn-a", "ip-2": "nn-a", "ip-3": "nn-b", "ip-4": "nn-b"})
    resolved, note = resolve_domains(ids, 2)
    assert note is None and [i.domain for i in resolved] == ["nn-a"] * 4 + ["nn-b"] * 4
    assert _check(resolved, replica_holders(ids, 2, False), 2) == (2, 0)


def test_a_node_without_the_label_makes_the_whole_job_use_the_next_level() -> None:
    """A mixed granularity never counts as a domain: one node's missing layer 3 skips the level."""
    ids = _chains({"ip-1": "nn-a", "ip-2": None, "ip-3": "nn-b", "ip-4": "nn-b"})
    resolved, note = resolve_domains(ids, 2)
    assert note is not None and f"node(s) ip-2 lack {L3}" in note and note.endswith(f"using {HOST}")
    assert {i.domain for i in resolved} == {"ip-1", "ip-2", "ip-3", "ip-4"}


def test_plain_domains_are_taken_as_they_are() -> None:
    assert domain_levels("rack-a") == [("domain", "rack-a")]
    assert domain_levels(f"{L3}=nn-a,{HOST}=ip-1") == [(L3, "nn-a"), (HOST, "ip-1")]
    ids = _layout([1, 1])
    assert resolve_domains(ids, 2) == (ids, None)

"""The control plane's collectives run on a gloo group of their own beside a non-gloo default group
(issue 45 #18): two real ranks whose default group is torch's fake process group, a stand-in for
NCCL on a CPU host that communicates nothing. ``pretrain.session.control_collective`` must build a
gloo group with the control timeout, and attempt ids, save statuses and restore agreement (gather,
broadcast, all-true, min) must give the agreed result there; the same calls on the default group
give each rank its own data back (or fail), which is what the test would see if the control plane stayed on
it. On a gloo default group no second group is made."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pretrain.session import CONTROL_TIMEOUT, control_collective
from tests.helpers import two_gloo_ranks
from tiering.collective import Collective, TorchCollective


def _agree(coll: Collective, rank: int) -> dict[str, Any]:
    """What the control plane asks of its collectives, with a different answer per rank."""
    coll.barrier()
    return {
        "gathered": coll.all_gather({"rank": rank, "attempt": f"a{rank}"}),
        "broadcast": coll.broadcast(f"from-{rank}", src=1),
        "all_true": coll.all_true(rank == 0),
        "min": coll.min_int(10 - rank),
    }


def _scenario(rank: int, root: Path) -> dict[str, Any]:
    coll = control_collective()
    group = coll._group  # noqa: SLF001 - which group the control plane was given is what is tested
    result: dict[str, Any] = {
        "default_backend": dist.get_backend(),
        "own_group": group is not None and group is not dist.group.WORLD,
        "world_size": coll.world_size,
        "control": _agree(coll, rank),
    }
    if group is not None:
        result["backend"] = dist.get_backend(group)
        result["timeout_s"] = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()  # noqa: SLF001
        # Gather only: a broadcast on the fake group reads an uninitialised size and fails outright.
        result["default_group"] = TorchCollective().all_gather({"rank": rank, "attempt": f"a{rank}"})
    return result


AGREED = {
    "gathered": [{"rank": 0, "attempt": "a0"}, {"rank": 1, "attempt": "a1"}],
    "broadcast": "from-1",
    "all_true": False,
    "min": 9,
}


def test_control_collectives_run_on_their_own_gloo_group_beside_a_non_gloo_default(tmp_path: Path) -> None:
    ranks = two_gloo_ranks(functools.partial(_scenario), tmp_path / "fake", default_backend="fake")
    for rank, got in enumerate(ranks):
        assert got["default_backend"] == "fake" and got["own_group"], got
        assert got["backend"] == "gloo" and got["world_size"] == 2, got
        assert got["timeout_s"] == CONTROL_TIMEOUT.total_seconds(), got
        assert got["control"] == AGREED, (rank, got["control"])
        # The default group gives this rank its own data back: the control plane there would disagree.
        assert got["default_group"] == [{"rank": rank, "attempt": f"a{rank}"}] * 2, got


def test_on_a_gloo_default_group_the_control_plane_uses_it_and_agrees(tmp_path: Path) -> None:
    ranks = two_gloo_ranks(functools.partial(_scenario), tmp_path / "gloo")
    for got in ranks:
        assert got["default_backend"] == "gloo" and not got["own_group"], got
        assert got["control"] == AGREED, got["control"]

"""A DCP ``.metadata`` carrying a pickle gadget (an ``os.system`` reduce) in a reshardable step
whose digests were recomputed to match: refused in one line, nothing executes (the marker file
the gadget would create never appears), the step is quarantined and the previous verified step
chosen; DCP's own load of that file is refused too once the restricted reader is installed, while
a real DCP checkpoint still loads."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from pretrain.checkpointing import dcp_metadata
from tiering.collective import SingleProcess
from tiering.errors import VerificationError
from tiering.local.posix import PosixTier
from tiering.local.publish import PosixStepPublisher, manifest_for
from tiering.local.restore import select_newest_verified


class _Gadget:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _real_dcp(where: Path) -> dict[str, torch.Tensor]:
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5)}
    dcp.save(state, checkpoint_id=str(where))
    return state


def _publish(tier: PosixTier, step: int, model: Path) -> None:
    pub = PosixStepPublisher(tier.layout, SingleProcess(), f"w{step}")
    tmp = pub.begin(step)
    shutil.copytree(model, tmp / "model")
    pub.commit(tmp, manifest_for("r", step, 1, {"tp": 1, "pp": 1, "dp": 1}))


def test_a_pickle_gadget_metadata_is_refused_nothing_runs_and_the_older_step_is_chosen(tmp_path: Path) -> None:
    marker = tmp_path / "gadget-ran"
    good = tmp_path / "good-model"
    _real_dcp(good)
    bad = tmp_path / "bad-model"
    shutil.copytree(good, bad)
    (bad / ".metadata").write_bytes(pickle.dumps(_Gadget(marker)))
    tier = PosixTier(tmp_path / "staging", "r", keep=3)
    _publish(tier, 10, good)
    _publish(tier, 20, bad)  # its manifest matches its bytes: a writer of staging recomputed them
    selection = select_newest_verified(tier, SingleProcess(), check=dcp_metadata.check_step)
    assert selection is not None and selection.step == 10, "the previous verified step is chosen"
    [(step, reason)] = selection.rejected
    assert step == 20 and "posix.system is not a class DCP metadata holds" in reason and "\n" not in reason, reason
    assert "model/.metadata" in reason
    assert not marker.exists(), "the gadget never ran"
    assert tier.step_dirs() == [10] and any(tier.layout.quarantine_dir.glob("step-000000020.*"))


def test_dcp_own_load_goes_through_the_restricted_reader(tmp_path: Path) -> None:
    marker = tmp_path / "gadget-ran"
    state = _real_dcp(tmp_path / "model")
    dcp_metadata.install()
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(into, checkpoint_id=str(tmp_path / "model"))
    assert all(torch.equal(into[k], state[k]) for k in state), "a real checkpoint loads as before"
    dcp_metadata.check_step(tmp_path)
    (tmp_path / "model" / ".metadata").write_bytes(pickle.dumps(_Gadget(marker)))
    with pytest.raises(CheckpointException) as err:
        dcp.load(into, checkpoint_id=str(tmp_path / "model"))
    assert "posix.system is not a class DCP metadata holds" in repr(err.value.failures), err.value.failures
    with pytest.raises(VerificationError, match="DCP metadata refused"):
        dcp_metadata.check_step(tmp_path)
    assert not marker.exists(), "the gadget never ran"

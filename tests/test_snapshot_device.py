"""Which CUDA device the tier-1 writer thread binds to for a snapshot (``async_writer``).

The writer is one long-lived thread per process; a new thread's current CUDA device is 0, so for
local rank k > 0 it must bind to the device of the tensors it copies (stream, event wait and
pinned buffers there). The choice is a pure function of the staged tensors' devices, tested here
with recorded device indices and ``meta`` tensors; the binding itself (``torch.cuda.device``,
``torch.cuda.Stream(device=...)``) needs a GPU: the GPU check asserts it on cuda:0, and only a
node with two GPUs can show a rank on cuda:1 staying there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pretrain.checkpointing.async_writer import BackgroundWrite, snapshot_device, tensor_devices


def test_writer_binds_to_the_device_of_the_staged_cuda_tensors() -> None:
    recorded = [torch.device("cpu"), torch.device("cuda", 3), "cuda:3", torch.device("cpu")]
    assert snapshot_device(recorded) == torch.device("cuda", 3)


def test_a_snapshot_without_cuda_tensors_binds_to_no_device() -> None:
    staged = {"model": {"w": torch.empty(2, 3, device="meta")}, "rng": [torch.zeros(4)], "step": 7}
    assert tensor_devices(staged) == {torch.device("meta"), torch.device("cpu")}
    assert snapshot_device(tensor_devices(staged)) is None


def test_tensors_on_two_gpus_are_refused_naming_both() -> None:
    with pytest.raises(ValueError, match=r"\['cuda:1', 'cuda:2'\].*one GPU"):
        snapshot_device(["cuda:1", "cuda:2", "cpu"])


def test_thread_writer_on_cpu_records_no_binding_and_copies_the_state(tmp_path: Path) -> None:
    state = {"w": torch.arange(6.0), "nested": [torch.ones(2)], "step": 3}
    save = BackgroundWrite("thread", state, tmp_path / "state.pt")
    save.wait_for_snapshot()
    state["w"].add_(1)  # the optimizer step after the wait: not in the snapshot
    outcome = save.poll(block=True)
    assert outcome is not None and outcome.ok, outcome
    assert save.device is None and save.copy_binding is None
    written = torch.load(tmp_path / "state.pt", weights_only=True)
    assert torch.equal(written["w"], torch.arange(6.0)) and written["step"] == 3

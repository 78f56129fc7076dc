"""Which GPU a rank selects before NCCL starts (``pretrain.platform.rank_device``).

The choice is a pure function of ``LOCAL_RANK`` and the number of visible GPUs, tested here
with recorded counts; ``torch.cuda.set_device`` itself needs a GPU (the GPU check runs one rank
on cuda:0, where the selection cannot be told apart from the default: a node with two GPUs is
needed to see rank 1 on cuda:1).
"""

from __future__ import annotations

import pytest

from pretrain.platform.rank_device import rank_device_index, select_rank_device


def test_each_local_rank_selects_its_own_gpu() -> None:
    assert [rank_device_index({"LOCAL_RANK": str(r)}, 8) for r in range(8)] == list(range(8))


def test_a_single_process_run_without_local_rank_uses_the_first_gpu() -> None:
    assert rank_device_index({}, 1) == 0


def test_no_visible_gpu_selects_nothing_whatever_local_rank_says() -> None:
    assert rank_device_index({"LOCAL_RANK": "5"}, 0) is None
    assert select_rank_device() is None  # this CPU host


def test_local_rank_past_the_visible_gpus_is_a_one_line_error() -> None:
    with pytest.raises(ValueError, match=r"^LOCAL_RANK=2 but 2 GPU\(s\) visible; fix: ") as info:
        rank_device_index({"LOCAL_RANK": "2"}, 2)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"LOCAL_RANK='x' is not an integer; fix: "):
        rank_device_index({"LOCAL_RANK": "x"}, 2)

"""Which GPU a rank selects before NCCL starts (``pretrain.platform.rank_device``).

The choice is a pure function of ``LOCAL_RANK`` and the number of visible GPUs, tested here
with recorded counts; ``torch.cuda.set_device`` itself needs a GPU (the GPU check runs one rank
on cuda:0, where the selection cannot be told apart from the default: a node with two GPUs is
needed to see rank 1 on cuda:1).
"""

from __future__ import annotations

import ast

import pytest

from pretrain.platform.rank_device import rank_device_index, select_rank_device
from tests.helpers import REPO


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


def _own_calls(fn: ast.FunctionDef, name: str) -> list[int]:
    """Line numbers of calls to ``name`` (plain or attribute) in ``fn``'s own body, not in nested functions."""
    lines, todo = [], list(ast.iter_child_nodes(fn))
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.Call):
            callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if callee == name:
                lines.append(node.lineno)
        todo.extend(ast.iter_child_nodes(node))
    return lines


def test_every_process_group_of_the_rank_program_starts_after_its_gpu_is_selected() -> None:
    """Each function of ``pretrain/`` that calls ``init_process_group`` selects the rank's GPU first
    (issue 45 #5: ``pretrain evaluate`` put every rank on cuda:0)."""
    found = []
    for path in sorted((REPO / "pretrain").rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef) or not (inits := _own_calls(fn, "init_process_group")):
                continue
            where = f"{path.relative_to(REPO)}:{fn.name}"
            found.append(where)
            selects = _own_calls(fn, "select_rank_device")
            assert selects and min(selects) < min(inits), f"{where} starts a process group before select_rank_device()"
    assert sorted(found) == [
        "pretrain/commands/evaluate.py:evaluate",
        "pretrain/platform/allreduce_check.py:main",
        "pretrain/resilience/inprocess.py:one_incarnation",
        "pretrain/train.py:train",
    ]

"""The rank program imports without the optional format readers and services a GPU machine lacks
(issue 45, finding 1): a fresh process where ``zstandard``, ``pyarrow``, ``boto3`` and the other
optional packages cannot be imported still imports the trainer, the evaluator, the standby server
and the GPU check's drivers; reading a ``.zst`` file there fails with one line naming the file and
the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO

# Not on the GPU machine and not carried by scripts/fetch-gpu-wheels.sh (pyarrow is there, but only
# Parquet input needs it); None in sys.modules is exactly how "not installed" reads to importers.
OPTIONAL = ("zstandard", "pyarrow", "boto3", "botocore", "matplotlib", "fuse", "tensorboard")
RANK_PROGRAM = (
    "pretrain.train",
    "pretrain.session",
    "pretrain.evaluation",
    "pretrain.commands.evaluate",
    "pretrain.cli",
    "pretrain.resilience.standby.server",
    "pretrain.resilience.inprocess",
    "tests.gpu.train_driver",
    "tests.gpu.reshard_rank",
)

_WITHOUT = """
import importlib, sys
for name in {optional!r}:
    sys.modules[name] = None
{body}
"""


def _run_without_optional(body: str) -> subprocess.CompletedProcess[str]:
    code = _WITHOUT.format(optional=OPTIONAL, body=body)
    return subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300
    )


def test_the_rank_program_imports_without_optional_readers() -> None:
    done = _run_without_optional(
        f"for m in {RANK_PROGRAM!r}:\n    importlib.import_module(m)\n"
        f"print(sorted(n for n in {OPTIONAL!r} if sys.modules.get(n) is not None))"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_zst_input_without_zstandard_names_the_file_and_the_fix(tmp_path: Path) -> None:
    src = tmp_path / "docs.jsonl.zst"
    src.write_bytes(b"\x28\xb5\x2f\xfd")  # never decoded: the package is missing first
    done = _run_without_optional(
        "from pretrain.data.sources import read_documents\n"
        "from pretrain.errors import DataError\n"
        "try:\n"
        f"    list(read_documents([{str(src)!r}]))\n"
        "except DataError as exc:\n"
        "    print('DataError:', exc)\n"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith(f"DataError: {src}: reading .zst input needs the zstandard package")
    assert "fix: pip install zstandard" in line

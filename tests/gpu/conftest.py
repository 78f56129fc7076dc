"""The single-GPU check's harness: which device it runs on, and its one JSON report.

* ``GPU_CHECK_MODE=cuda`` (default): every test skips cleanly when CUDA is absent;
  ``GPU_CHECK_MODE=cpu`` (``scripts/gpu-check.sh --cpu``, the dry run in ``make test``) runs the
  same entry points at CPU size.
* ``GPU_CHECK_REPORT=FILE``: the one report, rewritten after every test and at the end of the
  session (a run cut short by its time limit keeps what ran): the versions that ran (torch,
  CUDA, GPU, megatron-core, NVRx, Transformer Engine), and per test its outcome, a one-line error
  if it failed, and the figures it recorded (``record`` fixture). A test that fails is recorded
  and the others still run.
* ``GPU_CHECK_WORKDIR=DIR``: where the runs write (default: a pytest temporary directory).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pretrain.platform.versions import framework_versions

MODE = os.environ.get("GPU_CHECK_MODE", "cuda")
_RESULTS: dict[str, dict[str, Any]] = {}
_STARTED = time.time()


def versions() -> dict[str, Any]:
    out: dict[str, Any] = dict(framework_versions())
    out["cuda"] = torch.version.cuda or "none"
    out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    out["transformer_engine_importable"] = importlib.util.find_spec("transformer_engine") is not None
    out["platform"] = platform.platform()
    return out


@pytest.fixture(scope="session")
def mode() -> str:
    if MODE not in ("cuda", "cpu"):
        pytest.fail(f"GPU_CHECK_MODE={MODE!r}; fix: cuda or cpu")
    if MODE == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device; fix: run on a GPU, or scripts/gpu-check.sh --cpu for the CPU dry run")
    return MODE


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("GPU_CHECK_WORKDIR")
    if given:
        Path(given).mkdir(parents=True, exist_ok=True)
        return Path(given)
    return tmp_path_factory.mktemp("gpu-check")


@pytest.fixture
def record(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Figures a test wants in the report (kept even when it fails later)."""
    return _RESULTS.setdefault(request.node.name, {}).setdefault("figures", {})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _RESULTS.setdefault(report.nodeid.split("::")[-1], {})
    entry["seconds"] = round(entry.get("seconds", 0.0) + report.duration, 2)  # setup (shared runs) included
    if report.when == "call" or report.outcome != "passed":
        entry["outcome"] = report.outcome
        if report.failed:
            entry["error"] = (report.longreprtext.strip().splitlines() or ["?"])[-1][:500]
        elif report.skipped and isinstance(report.longrepr, tuple):
            entry["reason"] = str(report.longrepr[2])
    if report.when == "teardown":
        _write_report(None)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _write_report(int(exitstatus))


def _write_report(exitstatus: int | None) -> None:
    """The report so far (``exit_status`` None until the session ends)."""
    path = os.environ.get("GPU_CHECK_REPORT")
    if not path:
        return
    report = {
        "mode": MODE,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(_STARTED)),
        "seconds": round(time.time() - _STARTED, 1),
        "versions": versions(),
        "image_digest": os.environ.get("IMAGE_DIGEST", "unknown"),
        "tests": _RESULTS,
        "passed": sum(1 for r in _RESULTS.values() if r.get("outcome") == "passed"),
        "failed": sum(1 for r in _RESULTS.values() if r.get("outcome") == "failed"),
        "skipped": sum(1 for r in _RESULTS.values() if r.get("outcome") == "skipped"),
        "exit_status": exitstatus,
    }
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    tmp.replace(path)  # a reader never sees half a report

"""``tiering`` stands alone (flags only); ``pretrain upload``/``pretrain gc`` map a config onto it.

Real published staging steps, a real ``file://`` object store (the S3 protocol in a directory).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.helpers import PYTHON, TINY
from tiering.collective import SingleProcess
from tiering.digest import PORTABLE_HASH, HashSpec
from tiering.layout import RunLayout
from tiering.local.publish import PosixStepPublisher, manifest_for
from tiering.remote.tier import RemoteTier
from tiering.trust.run_key import load_or_create
from tiering.trust.signature import SIGNATURE_NAME, ManifestSigner


def _run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", module, *args], capture_output=True, text=True, timeout=120)


def _publish(staging: Path, step: int, signer: ManifestSigner | None) -> Path:
    """A staging step as the trainer writes it (blake3, signed with ``signer``)."""
    layout = RunLayout(staging, "run")
    pub = PosixStepPublisher(layout, SingleProcess(), "a1", HashSpec(PORTABLE_HASH), signer)
    tmp = pub.begin(step)
    (tmp / "trainer.pt").write_bytes(bytes([step]) * 1000)
    pub.commit(tmp, manifest_for("run", step, 1, {"tp": 1, "pp": 1, "dp": 1}))
    return layout.step_dir(step)


def _config_args(staging: Path, uri: str, *sets: str) -> list[str]:
    runs = staging.parent / "runs"  # the run key lives in <run.dir>/<run id>/run.key
    settings = ["run.id=run", f"run.dir={runs}", f"checkpoint.reshardable.dir={staging}", f"checkpoint.s3.uri={uri}"]
    settings += sets
    return ["--config", str(TINY), *(arg for item in settings for arg in ("--set", item))]


def test_pretrain_upload_and_gc_read_the_config_and_share_state_with_tiering(tmp_path: Path) -> None:
    staging, uri = tmp_path / "staging", f"file://{tmp_path / 'objects'}"
    key_file = tmp_path / "runs" / "run" / "run.key"  # the trainer's, as rank 0 creates it
    signer = ManifestSigner(load_or_create(key_file))
    for step in (10, 20, 30):
        _publish(staging, step, signer)
    _publish(staging, 40, None)  # unsigned: never promoted
    up = _run("pretrain", "upload", *_config_args(staging, uri, "checkpoint.s3.owner=alice"), "--once")
    assert up.returncode == 0, up.stderr
    assert json.loads(up.stdout.splitlines()[-1]) == {"uploaded": [10, 20, 30], "pending": [40]}
    assert "promoted step 30" in up.stderr, "the uploader's log reaches stderr"
    assert f"step-000000040/{SIGNATURE_NAME}: SIGNATURE is missing" in up.stderr, up.stderr
    assert RemoteTier.open(uri, "run").committed_steps() == [30, 20, 10]
    # The same lease through tiering's own flags: another owner is refused.
    argv = ["upload", uri, "--run-id", "run", "--staging-dir", str(staging), "--owner", "bob"]
    refused = _run("tiering", *argv, "--run-key-file", str(key_file))
    assert refused.returncode == 1 and "owned by 'alice'" in refused.stderr
    # GC: the first pass (tiering flags) marks, the second (the config's keep) deletes.
    marked = _run("tiering", "gc", uri, "--run-id", "run", "--keep", "1", "--apply")
    assert marked.returncode == 0 and "marked now [10]; deleted []" in marked.stdout, marked.stderr
    swept = _run(
        "pretrain", "gc", *_config_args(staging, uri, "checkpoint.s3.keep=1", "checkpoint.s3.gc_min_age_s=0"), "--apply"
    )
    assert swept.returncode == 0 and "deleted [10]" in swept.stdout, swept.stderr
    assert RemoteTier.open(uri, "run").committed_steps() == [30, 20]


def test_config_errors_are_one_line_with_a_fix(tmp_path: Path) -> None:
    no_uri = _run("pretrain", "gc", "--config", str(TINY))
    assert no_uri.returncode == 2 and no_uri.stderr.count("\n") == 1
    assert str(TINY) in no_uri.stderr and "checkpoint.s3.uri is not set" in no_uri.stderr and "fix:" in no_uri.stderr
    moved = _run("tiering", "upload", "--config", str(TINY), "--watch")
    assert moved.returncode == 2 and moved.stderr.count("\n") == 1
    assert f"fix: run 'pretrain upload --config {TINY}" in moved.stderr
    bad_keep = _run("tiering", "gc", f"file://{tmp_path}", "--run-id", "run", "--keep", "0")
    assert bad_keep.returncode == 2 and "--keep" in bad_keep.stderr


def test_tiering_imports_no_pretrain_module() -> None:
    probe = (
        "import importlib, pkgutil, sys, tiering\n"
        "for mod in pkgutil.walk_packages(tiering.__path__, 'tiering.'):\n"
        "    importlib.import_module(mod.name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'pretrain'))\n"
    )
    out = subprocess.run([PYTHON, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_launcher_and_the_publish_protocol_load_no_torch() -> None:
    """`pretrain launch` (run by Slurm/Kubernetes before any rank) and the publish protocol stay
    light: torch is for the ranks and the transport only (a launcher that imports it prints CUDA
    warnings into its one-line errors and takes seconds longer to start)."""
    probe = (
        "import sys\n"
        "import pretrain.commands.launch, tiering.local.publish, tiering.verify, tiering.remote.tier\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([PYTHON, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "torch was imported"

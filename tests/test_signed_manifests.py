"""Signed manifests of the reshardable (staging) tier and of S3 (tiering/trust/signature.py).

A writer of the shared staging volume or of the bucket without the run key plants a newer step
whose DCP ``.metadata`` is a pickle gadget (an ``os.system`` reduce) with every digest and
``COMMITTED`` recomputed: the reader refuses it on its ``SIGNATURE`` (missing, or made with another
key) before any byte is hashed or unpickled, in one line naming the file and the fix, the gadget
never runs (its marker file never appears), and the previous signed step is restored. The uploader
never promotes such a step; the S3 download refuses it before any GET of its data; a signed
manifest naming a digest other than blake3 is refused on read. Real files, the real publish path,
the file:// store and a real Ceph RGW bucket.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pretrain.checkpointing import dcp_metadata
from tests.helpers import PYTHON
from tests.test_s3_tier import KEY_SECRET, RUN, SIGNER, run_key_file  # noqa: F401 (the fixture: autouse here too)
from tiering.collective import SingleProcess
from tiering.digest import LOCAL_HASH, PORTABLE_HASH, HashSpec
from tiering.errors import AlreadyCommitted, VerificationError
from tiering.layout import RunLayout
from tiering.local.posix import PosixTier
from tiering.local.publish import PosixStepPublisher, manifest_for
from tiering.local.restore import select_newest_verified
from tiering.remote.objectstore import open_store
from tiering.remote.tier import RemoteTier
from tiering.remote.uploader import Uploader
from tiering.trust.run_key import ENV_VAR, RunKey
from tiering.trust.signature import SIGNATURE_NAME, ManifestSigner
from tiering.verify import read_manifest

ROGUE = ManifestSigner(RunKey(bytes(reversed(range(32)))))  # a key that is not the run's


class _Gadget:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def models(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A real DCP checkpoint, the same with a gadget ``.metadata``, and the gadget's marker."""
    good, bad, marker = tmp_path / "good-model", tmp_path / "bad-model", tmp_path / "gadget-ran"
    dcp.save({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, checkpoint_id=str(good))
    shutil.copytree(good, bad)
    (bad / ".metadata").write_bytes(pickle.dumps(_Gadget(marker)))
    return good, bad, marker


def _publish(root: Path, step: int, model: Path, signer: ManifestSigner | None, hash_name: str = PORTABLE_HASH) -> Path:
    layout = RunLayout(root, RUN)
    pub = PosixStepPublisher(layout, SingleProcess(), f"w{step}", HashSpec(hash_name, 64 * 1024, 1), signer)
    tmp = pub.begin(step)
    shutil.copytree(model, tmp / "model")
    (tmp / "trainer.pt").write_bytes(bytes([step]) * 100_000)
    pub.commit(tmp, manifest_for(RUN, step, 1, {"tp": 1, "pp": 1, "dp": 1}))
    return layout.step_dir(step)


def _staging(root: Path) -> PosixTier:
    return PosixTier(root, RUN, keep=3, name="reshardable", expect_hash=PORTABLE_HASH, signer=SIGNER)


def _one_line_naming_signature(reason: str, where: Path | str) -> None:
    assert "\n" not in reason and f"{where}/{SIGNATURE_NAME}" in reason and "fix:" in reason, reason


@pytest.mark.parametrize("forger", ["no signature", "another key"])
def test_a_forged_staging_step_with_a_gadget_is_refused_before_unpickling(
    tmp_path: Path, models: tuple[Path, Path, Path], forger: str
) -> None:
    good, bad, marker = models
    staging = tmp_path / "staging"
    _publish(staging, 10, good, SIGNER)
    forged = _publish(staging, 20, bad, None if forger == "no signature" else ROGUE)
    tier = _staging(staging)
    selection = select_newest_verified(tier, SingleProcess(), check=dcp_metadata.check_step)
    assert selection is not None and selection.step == 10, "the previous signed step is restored"
    [(step, reason)] = selection.rejected
    assert step == 20
    _one_line_naming_signature(reason, forged)
    assert ("is missing" if forger == "no signature" else "does not verify") in reason, reason
    assert not marker.exists(), "the gadget never ran"
    assert tier.step_dirs() == [10] and any(tier.layout.quarantine_dir.glob("step-000000020.*"))


def test_the_signature_is_checked_before_any_byte_is_hashed(tmp_path: Path, models: tuple[Path, Path, Path]) -> None:
    good, _, _ = models
    step = _publish(tmp_path, 10, good, SIGNER)
    assert (step / SIGNATURE_NAME).read_bytes().startswith(b"hmac-sha256:")
    assert _staging(tmp_path).verify(10).step == 10, "the run's own signed step verifies"
    with open(step / "trainer.pt", "r+b") as fh:  # a torn byte and a bad signature: the signature is named
        fh.write(b"\xff")
    (step / SIGNATURE_NAME).write_bytes(ROGUE.sign((step / "manifest.json").read_bytes()))
    with pytest.raises(VerificationError) as err:
        _staging(tmp_path).verify(10)
    assert err.value.path == str(step / SIGNATURE_NAME) and "does not verify" in err.value.reason
    (step / SIGNATURE_NAME).write_bytes(SIGNER.sign((step / "manifest.json").read_bytes()))
    with pytest.raises(VerificationError, match="trainer.pt"):  # signed again: now the bytes are checked
        _staging(tmp_path).verify(10)
    assert PosixTier(tmp_path, RUN).apply_retention() == [], "an unsigned reader keeps what it cannot judge"


def test_retention_never_counts_a_forged_step_as_kept(tmp_path: Path, models: tuple[Path, Path, Path]) -> None:
    good, bad, _ = models
    for step in (10, 20):
        _publish(tmp_path, step, good, SIGNER)
    for step in (30, 40):
        _publish(tmp_path, step, bad, ROGUE)  # newer forged steps must not push the signed ones out
    tier = PosixTier(tmp_path, RUN, keep=1, expect_hash=PORTABLE_HASH, signer=SIGNER)
    assert tier.apply_retention() == [10] and tier.step_dirs() == [40, 30, 20], "the newest signed step is kept"


def _remote(uri: str, endpoint: str | None, signer: ManifestSigner | None, expect_hash: str | None) -> RemoteTier:
    store, prefix = open_store(uri, endpoint, chunk_mb=5)
    return RemoteTier(store, prefix, RUN, signer=signer, expect_hash=expect_hash)


@pytest.mark.parametrize("forger", ["no signature", "another key"])
def test_a_forged_s3_step_with_a_gadget_is_refused_and_the_previous_step_restored(
    remote_uri: tuple[str, str | None], tmp_path: Path, models: tuple[Path, Path, Path], forger: str
) -> None:
    good, bad, marker = models
    staging = tmp_path / "staging"
    trainer = _remote(*remote_uri, SIGNER, PORTABLE_HASH)
    trainer.acquire_lease("uploader")
    trainer.upload_step(_publish(staging, 10, good, SIGNER))
    # A holder of the bucket's write credentials without the run key puts a newer step.
    rogue = _remote(*remote_uri, None, None)
    rogue.upload_step(_publish(tmp_path / "rogue", 20, bad, None if forger == "no signature" else ROGUE))
    assert trainer.committed_steps() == [20, 10]
    back = RunLayout(tmp_path / "back", RUN)
    got, rejected = trainer.restore_newest(back, "r")
    assert got == 10
    [(step, reason)] = rejected
    assert step == 20 and "\n" not in reason and "fix:" in reason, reason
    assert trainer.where(trainer.step_key(20, SIGNATURE_NAME)) in reason, reason
    assert not back.step_dir(20).exists() and not any(back.steps_dir.glob("*.tmp-*")), "nothing of it landed"
    assert (back.step_dir(10) / SIGNATURE_NAME).is_file(), "the restored step keeps its signature"
    selection = select_newest_verified(_staging(tmp_path / "back"), SingleProcess(), check=dcp_metadata.check_step)
    assert selection is not None and selection.step == 10 and selection.rejected == []
    assert not marker.exists(), "the gadget never ran"


def test_the_uploader_carries_the_signature_and_never_promotes_a_forged_step(
    remote_uri: tuple[str, str | None], tmp_path: Path, models: tuple[Path, Path, Path]
) -> None:
    good, bad, _ = models
    staging = tmp_path / "staging"
    signed = _publish(staging, 10, good, SIGNER)
    _publish(staging, 20, bad, ROGUE)  # a writer of the staging volume without the key
    remote = _remote(*remote_uri, SIGNER, PORTABLE_HASH)
    uploader = Uploader(remote, _staging(staging), "uploader")
    assert [r.step for r in uploader.run_once()] == [10]
    assert remote.committed_steps() == [10], "the forged step was never promoted"
    sig, _ = remote.store.get_bytes(remote.step_key(10, SIGNATURE_NAME))
    assert sig == (signed / SIGNATURE_NAME).read_bytes()


def test_a_committed_s3_step_is_never_overwritten(
    remote_uri: tuple[str, str | None], tmp_path: Path, models: tuple[Path, Path, Path]
) -> None:
    """Step 10 committed; a second step 10 signed with the run's key but holding other bytes (a
    re-run, a confused second uploader) is refused before any object is written, and the same step
    uploaded again is done without a write."""
    good, bad, _ = models
    remote = _remote(*remote_uri, SIGNER, PORTABLE_HASH)
    first_dir = _publish(tmp_path / "first", 10, good, SIGNER)
    first = remote.upload_step(first_dir)
    before = {o.key: remote.store.get_bytes(o.key)[0] for o in remote.store.list(remote.base + "/")}
    other = _publish(tmp_path / "other", 10, bad, SIGNER)
    with pytest.raises(AlreadyCommitted) as refused:
        remote.upload_step(other)
    assert "\n" not in str(refused.value) and "fix:" in str(refused.value)
    assert remote.where(remote.step_key(10, "COMMITTED")) in str(refused.value)
    after = {o.key: remote.store.get_bytes(o.key)[0] for o in remote.store.list(remote.base + "/")}
    assert after == before, "not one object of the committed step changed"
    again = remote.upload_step(first_dir)  # an uploader that died after its commit, restarted
    assert first.skipped_objects == 0 and again.skipped_objects == len(read_manifest(first_dir).files)
    assert {o.key: remote.store.get_bytes(o.key)[0] for o in remote.store.list(remote.base + "/")} == before


def test_a_signed_s3_manifest_naming_another_digest_is_refused(
    remote_uri: tuple[str, str | None], tmp_path: Path, models: tuple[Path, Path, Path]
) -> None:
    good, _, _ = models
    writer = _remote(*remote_uri, SIGNER, None)
    writer.acquire_lease("uploader")
    writer.upload_step(_publish(tmp_path / "staging", 10, good, SIGNER))
    writer.upload_step(_publish(tmp_path / "staging", 20, good, SIGNER, hash_name=LOCAL_HASH))
    got, rejected = _remote(*remote_uri, SIGNER, PORTABLE_HASH).restore_newest(RunLayout(tmp_path / "back", RUN), "r")
    assert got == 10
    [(step, reason)] = rejected
    assert step == 20 and f"is hashed with {LOCAL_HASH}, this tier reads {PORTABLE_HASH} only" in reason, reason


def test_tiering_restore_needs_the_run_key_and_refuses_a_forged_step(
    tmp_path: Path,
    models: tuple[Path, Path, Path],
    run_key_file: Path,  # noqa: F811
) -> None:
    good, bad, marker = models
    uri = f"file://{tmp_path / 'objects'}"
    writer = _remote(uri, None, SIGNER, PORTABLE_HASH)
    writer.acquire_lease("uploader")
    writer.upload_step(_publish(tmp_path / "staging", 10, good, SIGNER))
    _remote(uri, None, None, None).upload_step(_publish(tmp_path / "rogue", 20, bad, ROGUE))
    argv = [PYTHON, "-m", "tiering", "restore", uri, "--run-id", RUN, "--to", str(tmp_path / "back")]
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    keyless = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert keyless.returncode == 2 and keyless.stderr.count("\n") == 1, keyless.stderr
    assert "no run key" in keyless.stderr and "fix:" in keyless.stderr
    assert not (tmp_path / "back" / RUN / "steps").exists()
    done = subprocess.run([*argv, "--run-key-file", str(run_key_file)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "restored step 10" in done.stdout, done.stderr
    assert "rejected step 20" in done.stdout and "SIGNATURE does not verify" in done.stdout, done.stdout
    assert not marker.exists() and KEY_SECRET not in done.stdout.encode() + done.stderr.encode()

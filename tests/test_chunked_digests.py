"""Manifest format v2: chunked digests agree with whole-file hashing on awkward sizes, and every
corruption of a chunk or of a chunk list is caught on tier 1, on a replica and in the object store,
named by file and chunk, quarantined, and the next older verified step is used instead."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from pretrain.checkpointing.rank_payload import load_verified_state
from tests.corruptions import CHUNK, CORRUPTIONS, RUN, STATE, publish_step, state_bytes
from tests.helpers import arrived, events, metrics_by_step, overrides_for, torchrun
from tiering.collective import SingleProcess
from tiering.digest import (
    LOCAL_HASH,
    PORTABLE_HASH,
    READ_BLOCK,
    ChunkedDigest,
    HashSpec,
    check_file,
    hash_bytes,
    hash_file,
)
from tiering.errors import ReplicaRejected, VerificationError
from tiering.layout import RunLayout
from tiering.local.posix import primary_store, replica_store
from tiering.local.publish import publish_received
from tiering.manifest import MANIFEST_NAME, Manifest
from tiering.peer.restore import PeerRecovery
from tiering.peer.transport import Transport
from tiering.remote.tier import RemoteTier
from tiering.system.fsio import write_file_durably
from tiering.system.page_cache import cached_bytes, evict
from tiering.trust.run_key import RunKey
from tiering.verify import verify_step


# -- chunked hashing == whole-file hashing ---------------------------------------------------------
def _serial(data: bytes, name: str, chunk: int) -> ChunkedDigest:
    """The definition, computed the slow obvious way: one chunk after the other."""
    chunks = tuple(hash_bytes(name, data[start : start + chunk]) for start in range(0, len(data), chunk))
    return ChunkedDigest(name, chunk, len(data), chunks)


@pytest.mark.parametrize("name", [LOCAL_HASH, PORTABLE_HASH, "sha256"])
@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7])
def test_chunk_verification_equals_whole_file_verification(tmp_path: Path, name: str, size: int) -> None:
    rng = random.Random(size)
    data = rng.randbytes(size)
    path = tmp_path / "f.bin"
    spec = HashSpec(name, CHUNK, 2)

    def write_in_awkward_pieces(fh: object) -> None:
        pos = 0
        while pos < size:
            n = rng.choice([1, 7, 4096, CHUNK - 3, CHUNK + 5, 2 * CHUNK])
            fh.write(data[pos : pos + n])  # type: ignore[attr-defined]
            pos += n

    written = write_file_durably(path, write_in_awkward_pieces, spec)
    expected = _serial(data, name, CHUNK)
    assert written == expected, "hashed while writing, in pieces that straddle chunks"
    assert hash_file(path, spec) == expected, "hashed from disk on two threads"
    whole = hashlib.sha256(data).hexdigest()
    positions = [None] + ([0, size // 2, size - 1] if size else [])
    for pos in positions:
        corrupt = bytearray(data)
        if pos is not None:
            corrupt[pos] ^= 0x20
        path.write_bytes(bytes(corrupt))
        whole_ok = hashlib.sha256(corrupt).hexdigest() == whole
        try:
            check_file(path, expected, threads=2)
            chunks_ok = True
        except VerificationError as exc:
            chunks_ok = False
            assert f"chunk {pos // CHUNK} of {len(expected.chunks)}" in str(exc)
        assert chunks_ok == whole_ok, f"chunked and whole-file verification disagree at byte {pos}"


def test_a_chunk_is_hashed_alike_from_a_cold_disk_and_from_the_page_cache(tmp_path: Path) -> None:
    """A verifier reads a cold file in blocks with the next chunks requested ahead of its readers
    and hashes a cached one in place through a mapping (tiering/digest.py): both give the same
    digest, chunks of several reads included, and a flipped byte is caught either way."""
    chunk = 2 * READ_BLOCK + 4097  # three reads per chunk, the last one short
    data = random.Random(5).randbytes(6 * chunk + 3)
    path = tmp_path / "f.bin"
    spec = HashSpec(LOCAL_HASH, chunk, 2)
    write_file_durably(path, lambda fh: fh.write(data), spec)
    expected = _serial(data, LOCAL_HASH, chunk)
    with open(path, "rb") as fh:
        evict(path)
        cold = cached_bytes(fh.fileno(), 0, len(data))
        assert hash_file(path, spec) == expected, "hashed from a cold disk"
        warm = cached_bytes(fh.fileno(), 0, len(data))
        assert hash_file(path, spec) == expected, "hashed from the page cache"
    if cold is not None:  # this kernel has cachestat(2): the reads above took the two paths
        assert cold < len(data) // 2 and warm == len(data), f"cached bytes: {cold} after eviction, {warm} after a read"
    corrupt = bytearray(data)
    corrupt[chunk + READ_BLOCK + 1] ^= 1  # in the second read of chunk 1
    path.write_bytes(bytes(corrupt))
    for label in ("cold", "warm"):
        if label == "cold":
            evict(path)
        with pytest.raises(VerificationError, match="chunk 1 of 7"):
            check_file(path, expected, threads=2)


def _recover(node_root: Path) -> tuple[int | None, str | None, list[str]]:
    """The real tier 1-2 restore path of a one-rank job on one node."""
    topology = {"world_size": 1, "tp": 1, "pp": 1, "dp": 1}
    transport = Transport(None, 5, key=RunKey.generate())
    recovery = PeerRecovery(RUN, 0, 1, "node-a", node_root, SingleProcess(), transport, topology, 3, "r1")
    result = recovery.recover()
    restore = result.restore
    return (restore.step, restore.tier, result.rejected) if restore else (None, None, result.rejected)


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_tier1_corruption_falls_back_to_the_older_step(tmp_path: Path, corruption: str) -> None:
    store = primary_store(tmp_path, 0, RUN, 3)
    for step in (10, 20):
        publish_step(store.layout, step)
    damage, needle = CORRUPTIONS[corruption]
    damage(store.step_path(20))
    step, tier, rejected = _recover(tmp_path)
    assert (step, tier) == (10, "local")
    assert len(rejected) == 1 and needle in rejected[0] and "\n" not in rejected[0], rejected
    assert STATE in rejected[0] or MANIFEST_NAME in rejected[0], "the file is named"
    assert not store.step_path(20).exists()
    assert any(p.name.startswith("step-000000020") for p in store.layout.quarantine_dir.iterdir())


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_replica_corruption_falls_back_to_the_older_step(tmp_path: Path, corruption: str) -> None:
    store = replica_store(tmp_path, 0, RUN, 3)  # this node holds only a replica of rank 0
    for step in (10, 20):
        publish_step(store.layout, step)
    damage, needle = CORRUPTIONS[corruption]
    damage(store.step_path(20))
    step, tier, rejected = _recover(tmp_path)
    assert (step, tier) == (10, "peer")
    assert len(rejected) == 1 and needle in rejected[0], rejected
    assert not store.step_path(20).exists()


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_received_replica_with_a_corruption_is_never_committed(tmp_path: Path, corruption: str) -> None:
    """What a peer sent, checked on disk (format v1's path; the transport checks v2 chunks on
    arrival, tests/test_transport.py): the same damage in the bytes or the manifest."""
    good = publish_step(RunLayout(tmp_path / "sender", RUN), 20, owner=1)
    damage, needle = CORRUPTIONS[corruption]
    damage(good)
    raw = (good / MANIFEST_NAME).read_bytes()
    layout = RunLayout(tmp_path / "replicas", "rank-00001")
    with pytest.raises(VerificationError) as exc:
        publish_received(layout, arrived(layout, (RUN, 20, 1), raw, {STATE: (good / STATE).read_bytes()}), RUN, 20, 1)
    if "flipped" in corruption:
        assert isinstance(exc.value, ReplicaRejected) and needle in str(exc.value) and STATE in str(exc.value)
    elif "truncated" in corruption:
        assert "size differs" in str(exc.value)
    else:
        assert needle in str(exc.value)
    assert not layout.step_dir(20).exists() and not layout.tmp_dir(20, "a1").exists()


def _corrupt_object(remote: RemoteTier, step: int, corruption: str, staging: Path) -> None:
    """The same damage applied to the objects: bytes rewritten, or manifest + COMMITTED replaced."""
    copy = staging / "damaged"
    copy.mkdir()
    for name in (STATE, MANIFEST_NAME, "COMMITTED"):
        data, _ = remote.store.get_bytes(remote.step_key(step, name))
        (copy / name).write_bytes(data)
    CORRUPTIONS[corruption][0](copy)
    for name in (STATE, MANIFEST_NAME, "COMMITTED"):
        remote.store.put_bytes(remote.step_key(step, name), (copy / name).read_bytes())


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_object_store_corruption_falls_back_to_the_older_step(
    remote_uri: tuple[str, str | None], tmp_path: Path, corruption: str
) -> None:
    staging = RunLayout(tmp_path / "staging", RUN)
    spec = HashSpec(PORTABLE_HASH, CHUNK, 2)
    remote = RemoteTier.open(remote_uri[0], RUN, endpoint_url=remote_uri[1], concurrency=4)
    remote.acquire_lease("me")
    for step in (10, 20):
        remote.upload_step(publish_step(staging, step, spec))
    _corrupt_object(remote, 20, corruption, tmp_path)
    back = RunLayout(tmp_path / "back", RUN)
    step, rejected = remote.restore_newest(back, "r")
    assert step == 10
    needle = CORRUPTIONS[corruption][1]
    if "truncated" in corruption:
        needle = "bytes received"  # a ranged GET past the shortened object's end comes back short
    assert rejected and rejected[0][0] == 20 and needle in rejected[0][1] and "\n" not in rejected[0][1], rejected
    assert not back.step_dir(20).exists()
    assert (back.step_dir(10) / STATE).read_bytes() == state_bytes(10)
    verify_step(back.step_dir(10), expect_run_id=RUN)


# -- the v1 format still restores --------------------------------------------------------------------
FIXTURE = Path(__file__).parent / "fixtures" / "manifest-v1"


def test_v1_step_written_before_v2_verifies_and_loads(tmp_path: Path) -> None:
    """A tier-1 step written by the code of 2026-12-01 (format v1, one SHA-256 per file)."""
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURE / "t", root / "t")
    step_dir = root / "t" / "ranks" / "rank-00000" / "steps" / "step-000000010"
    manifest = verify_step(step_dir, expect_run_id="t")
    assert manifest.schema_version == 1 and manifest.files[0].sha256 and manifest.files[0].chunked is None
    payload = load_verified_state(step_dir / STATE)
    assert payload["trainer"]["step"] == 10 and isinstance(next(iter(payload["model"].values())), torch.Tensor)
    assert (
        Manifest.from_json((step_dir / MANIFEST_NAME).read_bytes(), step_dir).to_json()
        == (step_dir / MANIFEST_NAME).read_bytes()
    ), "a v1 manifest is kept as v1, byte for byte"
    with open(step_dir / STATE, "r+b") as fh:
        fh.seek(1000)
        fh.write(b"\x00\x01")
    with pytest.raises(VerificationError, match="SHA-256 does not match"):
        verify_step(step_dir)


V1_JOB = {
    "train.steps": 20,
    "checkpoint.local.interval": 10,
    "checkpoint.reshardable.enabled": "false",
    "checkpoint.replication.factor": 1,
    "model.num_layers": 1,
    "model.hidden_size": 32,
    "model.num_attention_heads": 2,
    "model.seq_length": 32,
    "data.global_batch_size": 4,
    "data.micro_batch_size": 2,
    "metrics.enabled": "false",
    "fault_tolerance.enabled": "false",
}


@pytest.mark.slow
def test_a_run_resumes_from_a_v1_step(tmp_path: Path, corpus: Path) -> None:
    """The fixture's run (same corpus, same settings) saved step 10 in format v1; today's code
    resumes it and trains on exactly as that run did (losses of steps 11-20 recorded with it),
    and its own next save is format v2."""
    shutil.copytree(FIXTURE / "t", tmp_path / "ckpt" / "t")
    torchrun(tmp_path, 1, overrides_for(tmp_path, corpus, **V1_JOB))
    restores = [e for e in events(tmp_path / "runs" / "t") if e["event"] == "restore"]
    assert [(r["step"], r["tier"]) for r in restores] == [(10, "local")]
    recorded = json.loads((FIXTURE / "losses.json").read_text())
    got = metrics_by_step(tmp_path / "runs" / "t")
    assert sorted(got) == list(range(11, 21)), "training went on from step 11"
    for step in range(11, 21):
        # Bit-exact on the machine the fixture was made on; another CPU may sum in another order.
        assert got[step]["loss"] == pytest.approx(recorded[str(step)], rel=1e-5), step
    new = json.loads(
        (tmp_path / "ckpt" / "t" / "ranks" / "rank-00000" / "steps" / "step-000000020" / MANIFEST_NAME).read_text()
    )
    assert new["schema_version"] == 2 and new["files"][0]["hash"] == LOCAL_HASH

"""Tier 3 on a real S3 server (Ceph RGW on loopback, or S3_ENDPOINT_URL) and on the file:// emulation."""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
from pathlib import Path

import boto3
import pytest
import torch

from tests.cluster.s3proxy import FaultProxy
from tests.helpers import (
    PYTHON,
    events,
    free_port,
    full_tensors,
    overrides_for,
    probe_restore,
    read_jsonl,
    torchrun,
    two_gloo_ranks,
)
from tiering.collective import SingleProcess, TorchCollective
from tiering.digest import PORTABLE_HASH, HashSpec
from tiering.errors import LeaseError, ObjectNotFound, ObjectStoreError, TransferInterrupted
from tiering.layout import RunLayout
from tiering.local.publish import PosixStepPublisher, manifest_for
from tiering.manifest import MANIFEST_NAME
from tiering.remote import gc as remote_gc
from tiering.remote.download import share_of
from tiering.remote.objectstore import PreconditionFailed, open_store
from tiering.remote.tier import RemoteTier
from tiering.trust.run_key import ENV_VAR, RunKey
from tiering.trust.signature import ManifestSigner
from tiering.verify import committed_marker, verify_step

RUN = "t"
KEY_SECRET = bytes(range(32))  # this module's run key: staging and S3 steps are signed with it
SIGNER = ManifestSigner(RunKey(KEY_SECRET))


@pytest.fixture(autouse=True)
def run_key_file(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The run key as the uploader and ``tiering restore`` read it (PRETRAIN_RUN_KEY_FILE, 0600);
    modules that import this fixture get it too."""
    path = tmp_path_factory.mktemp("key") / "run.key"
    path.touch(mode=0o600)
    path.write_bytes(KEY_SECRET)
    monkeypatch.setenv(ENV_VAR, str(path))
    return path


def make_step(root: Path, step: int, size: int = 300_000, shards: int = 2) -> Path:
    """A real published staging step with random shards (no training needed), signed and blake3
    as the reshardable tier writes it."""
    layout = RunLayout(root, RUN)
    pub = PosixStepPublisher(layout, SingleProcess(), f"a{step}", HashSpec(PORTABLE_HASH), SIGNER)
    tmp = pub.begin(step)
    (tmp / "model").mkdir()
    for i in range(shards):
        (tmp / "model" / f"__{i}_0.distcp").write_bytes(os.urandom(size))
    (tmp / "trainer.pt").write_bytes(os.urandom(1000))
    pub.commit(tmp, manifest_for(RUN, step, 1, {"tp": 1, "pp": 1, "dp": 1}))
    return layout.step_dir(step)


def _remote(uri: str, endpoint: str | None) -> RemoteTier:
    store, prefix = open_store(uri, endpoint, chunk_mb=5)
    return RemoteTier(store, prefix, RUN, signer=SIGNER, expect_hash=PORTABLE_HASH)


def _tiering(
    *args: str, env_extra: dict[str, str] | None = None, tmp: Path | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env_extra or {})}
    return subprocess.run([PYTHON, "-m", "tiering", *args], capture_output=True, text=True, timeout=300, env=env)


def _upload_args(staging: Path, uri: str, endpoint: str | None, *extra: str) -> list[str]:
    args = ["upload", uri, "--run-id", RUN, "--staging-dir", str(staging), "--multipart-chunk-mb", "5"]
    if endpoint:
        args += ["--endpoint-url", endpoint]
    return args + list(extra)


# -- protocol ---------------------------------------------------------------------------------


def test_conditional_writes(remote_uri: tuple[str, str | None]) -> None:
    store, _ = open_store(*remote_uri)
    etag = store.put_bytes("ckpt/x.json", b"1", if_none_match=True)
    with pytest.raises(PreconditionFailed):
        store.put_bytes("ckpt/x.json", b"2", if_none_match=True)
    new = store.put_bytes("ckpt/x.json", b"2", if_match=etag)
    with pytest.raises(PreconditionFailed):
        store.put_bytes("ckpt/x.json", b"3", if_match=etag)  # a second writer with the stale ETag loses
    assert store.get_bytes("ckpt/x.json") == (b"2", new)


def test_ranged_reads_arrive_in_pieces_and_stop_at_the_object_end(remote_uri: tuple[str, str | None]) -> None:
    store, _ = open_store(*remote_uri)
    data = os.urandom(1_000_003)
    store.put_bytes("ckpt/obj", data)
    pieces = list(store.iter_range("ckpt/obj", 10, 500_000, piece_bytes=65_536))
    assert b"".join(pieces) == data[10:500_010] and max(map(len, pieces)) <= 65_536 and len(pieces) >= 8
    assert b"".join(store.iter_range("ckpt/obj", 999_990, 4096)) == data[999_990:]  # short: the object ends
    assert list(store.iter_range("ckpt/obj", len(data), 4096)) == []  # past the end (S3: HTTP 416)
    missing = store.iter_range("ckpt/none", 0, 10)
    with pytest.raises(ObjectNotFound):
        next(missing)


def _chunked_step(staging: Path, step: int, size: int) -> Path:
    """A published step whose one data file has many BLAKE3 chunks (one ranged GET each)."""
    layout = RunLayout(staging, RUN)
    pub = PosixStepPublisher(layout, SingleProcess(), f"a{step}", HashSpec(PORTABLE_HASH, 256 * 1024, 2), SIGNER)
    tmp = pub.begin(step)
    (tmp / "model").mkdir()
    (tmp / "model" / "__0_0.distcp").write_bytes(os.urandom(size))
    pub.commit(tmp, manifest_for(RUN, step, 1, {"tp": 1, "pp": 1, "dp": 1}))
    return layout.step_dir(step)


def test_ranged_gets_broken_off_mid_body_are_asked_again(s3_endpoint: str, bucket: str, tmp_path: Path) -> None:
    """A proxy on the server's side resets connections half-way through chunk bodies: a restore
    asks each broken chunk again (fresh hash, same offset) and lands every byte; when the chunk
    keeps breaking, the restore fails in one line naming the object and publishes nothing."""
    step_dir = _chunked_step(tmp_path / "staging", 10, 2_000_000)
    RemoteTier.open(f"s3://{bucket}/ckpt", RUN, endpoint_url=s3_endpoint).upload_step(step_dir)
    proxy = FaultProxy("127.0.0.1", s3_endpoint)
    try:
        remote = RemoteTier.open(f"s3://{bucket}/ckpt", RUN, endpoint_url=proxy.url, concurrency=4)
        proxy.cut_bodies(2)  # fewer than FETCH_ATTEMPTS, however they fall on the chunks
        back = RunLayout(tmp_path / "back", RUN)
        assert remote.restore_newest(back, "r") == (10, [])
        assert proxy.counts["cut"] == 2, proxy.counts
        data = back.step_dir(10) / "model" / "__0_0.distcp"
        assert data.read_bytes() == (step_dir / "model" / "__0_0.distcp").read_bytes()
        verify_step(back.step_dir(10), expect_run_id=RUN)

        proxy.cut_bodies(1000)
        again = RunLayout(tmp_path / "again", RUN)
        with pytest.raises(TransferInterrupted, match=r"__0_0\.distcp: body broke off after \d+ of \d+ bytes") as err:
            remote.restore_newest(again, "r")
        assert "\n" not in str(err.value) and "fix:" in str(err.value)
        assert not again.step_dir(10).exists()
    finally:
        proxy.close()


def test_a_store_that_ignores_ranges_is_named_not_taken_for_corruption(
    s3_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    """206 rewritten to 200 (as a proxy without range support answers): the restore stops with the
    endpoint named and the fix; the step is not rejected as corrupt and nothing is published."""
    step_dir = _chunked_step(tmp_path / "staging", 10, 600_000)
    RemoteTier.open(f"s3://{bucket}/ckpt", RUN, endpoint_url=s3_endpoint).upload_step(step_dir)
    proxy = FaultProxy("127.0.0.1", s3_endpoint)
    try:
        proxy.answer_ranges_with_200()
        remote = RemoteTier.open(f"s3://{bucket}/ckpt", RUN, endpoint_url=proxy.url)
        back = RunLayout(tmp_path / "back", RUN)
        with pytest.raises(ObjectStoreError, match="got HTTP 200.*fix: the endpoint .* must honour Range") as err:
            remote.restore_newest(back, "r")
        assert "\n" not in str(err.value) and proxy.counts["range_200"] >= 1
        assert not back.step_dir(10).exists()
    finally:
        proxy.close()


def test_upload_then_restore_verifies_every_byte(remote_uri: tuple[str, str | None], tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    for step in (10, 20):
        make_step(staging, step, size=6_000_000)  # > 5 MB chunk: multipart
    out = _tiering(*_upload_args(staging, *remote_uri, "--once"))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {"uploaded": [10, 20], "pending": []}
    remote = _remote(*remote_uri)
    assert remote.committed_steps() == [20, 10] and remote.latest_hint() == 20
    restored = _tiering(
        "restore",
        remote_uri[0],
        "--run-id",
        RUN,
        "--to",
        str(tmp_path / "back"),
        *(["--endpoint-url", remote_uri[1]] if remote_uri[1] else []),
    )
    assert restored.returncode == 0 and "restored step 20" in restored.stdout, restored.stderr
    back = tmp_path / "back" / RUN / "steps" / "step-000000020"
    verify_step(back, expect_run_id=RUN)
    for rel in ("model/__0_0.distcp", "trainer.pt"):
        assert (back / rel).read_bytes() == (staging / RUN / "steps" / "step-000000020" / rel).read_bytes()


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _restore_shared(uri: str, endpoint: str, back: str, rank: int, _out: Path) -> dict:
    """One rank of a restore into a directory both ranks share: what it fetched, what it restored."""
    lines = _Lines()
    logging.getLogger("tiering.remote.download").addHandler(lines)
    logging.getLogger("tiering.remote.download").setLevel(logging.INFO)
    remote = RemoteTier.open(uri, RUN, endpoint_url=endpoint)
    step, rejected = remote.restore_newest(RunLayout(Path(back), RUN), f"r{rank}", coll=TorchCollective())
    fetched = [line for line in lines.lines if f"rank {rank} fetched" in line]
    return {"step": step, "rejected": [r for _, r in rejected], "fetched": fetched}


def test_every_rank_fetches_a_share_of_an_s3_step_and_a_bad_share_fails_it_on_all(
    s3_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    """Issue 45 #15: two ranks restore from the RGW into one shared directory; each fetches and
    checks its share of the files (none waits alone behind the other's download) and the published
    step is bit-equal to what was uploaded. A corrupted object in rank 1's share rejects that step on
    both ranks alike, and both fall back to the older step together."""
    staging = tmp_path / "staging"
    remote = RemoteTier.open(f"s3://{bucket}/ckpt", RUN, endpoint_url=s3_endpoint)
    remote.acquire_lease("me")
    for step in (10, 20):
        remote.upload_step(make_step(staging, step, size=400_000, shards=4))
    uri, back = f"s3://{bucket}/ckpt", tmp_path / "back"
    rows = two_gloo_ranks(functools.partial(_restore_shared, uri, s3_endpoint, str(back)), tmp_path / "ranks")
    assert [r["step"] for r in rows] == [20, 20] and [r["rejected"] for r in rows] == [[], []]
    counts = [int(r["fetched"][0].split("fetched ")[1].split(" of ")[0]) for r in rows]
    assert all(n > 0 for n in counts) and sum(counts) == 5, rows  # 4 shards + trainer.pt, each fetched once
    src, got = staging / RUN / "steps" / "step-000000020", back / RUN / "steps" / "step-000000020"
    verify_step(got, expect_run_id=RUN)
    files = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(got) for p in got.rglob("*") if p.is_file())
    assert all((src / rel).read_bytes() == (got / rel).read_bytes() for rel in files)

    manifest, _ = remote.read_manifest(20)
    victim = share_of(manifest.files, 1, 2)[0]
    _corrupt_remote(remote, 20, victim.path, os.urandom(victim.bytes))
    again = tmp_path / "again"
    rows = two_gloo_ranks(functools.partial(_restore_shared, uri, s3_endpoint, str(again)), tmp_path / "ranks2")
    assert [r["step"] for r in rows] == [10, 10], rows
    assert all(len(r["rejected"]) == 1 and victim.path in r["rejected"][0] for r in rows), rows
    assert not (again / RUN / "steps" / "step-000000020").exists()


def _corrupt_remote(remote: RemoteTier, step: int, rel: str, data: bytes) -> None:
    remote.store.put_bytes(remote.step_key(step, rel), data)


@pytest.mark.parametrize(
    "fault",
    [
        "overwritten object",
        "deleted object",
        "manifest without COMMITTED",
        "manifest path with ..",
        "latest.json names a missing step",
    ],
)
def test_bad_remote_steps_are_skipped(remote_uri: tuple[str, str | None], tmp_path: Path, fault: str) -> None:
    staging = tmp_path / "staging"
    for step in (10, 20):
        make_step(staging, step)
    remote = _remote(*remote_uri)
    remote.acquire_lease("me")
    for step in (10, 20):
        remote.upload_step(staging / RUN / "steps" / f"step-{step:09d}")
    expect = 10
    if fault == "overwritten object":
        _corrupt_remote(remote, 20, "model/__1_0.distcp", os.urandom(300_000))
    elif fault == "deleted object":
        remote.store.delete([remote.step_key(20, "model/__1_0.distcp")])
    elif fault == "manifest without COMMITTED":
        remote.store.delete([remote.step_key(20, "COMMITTED")])
    elif fault == "manifest path with ..":
        raw, _ = remote.store.get_bytes(remote.step_key(20, MANIFEST_NAME))
        body = json.loads(raw)
        body["files"][0]["path"] = "../step-000000010/trainer.pt"
        new = json.dumps(body).encode()
        remote.store.put_bytes(remote.step_key(20, MANIFEST_NAME), new)
        remote.store.put_bytes(remote.step_key(20, "COMMITTED"), committed_marker(20, new))
        remote.store.put_bytes(remote.step_key(20, "SIGNATURE"), SIGNER.sign(new))  # a writer with the key
    else:
        remote.store.put_bytes(remote.key("latest.json"), b'{"step": 999, "path": "steps/step-000000999"}')
        expect = 20
    step, rejected = remote.restore_newest(RunLayout(tmp_path / "back", RUN), "r")
    assert step == expect
    if expect == 10:
        if fault != "manifest without COMMITTED":
            assert rejected and rejected[0][0] == 20
            assert "\n" not in rejected[0][1]
        if fault == "overwritten object":
            assert "__1_0.distcp" in rejected[0][1] and "chunk 0 of 1" in rejected[0][1]
        if fault == "deleted object":
            assert "__1_0.distcp" in rejected[0][1] and "object is missing" in rejected[0][1], rejected
        if fault == "manifest path with ..":
            assert "escapes" in rejected[0][1]
    assert not (tmp_path / "back" / RUN / "steps" / "step-000000020").exists() or expect == 20


def test_second_owner_is_refused(remote_uri: tuple[str, str | None], tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    make_step(staging, 10)
    first = _tiering(*_upload_args(staging, *remote_uri, "--once", "--owner", "alice"))
    assert first.returncode == 0, first.stderr
    make_step(staging, 20)
    second = _tiering(*_upload_args(staging, *remote_uri, "--once", "--owner", "bob"))
    assert second.returncode == 1 and "owned by 'alice'" in second.stderr and "not 'bob'" in second.stderr
    assert _remote(*remote_uri).committed_steps() == [10], "the refused uploader wrote nothing"
    with pytest.raises(LeaseError):
        _remote(*remote_uri).acquire_lease("carol")


def test_gc_marks_then_deletes_and_keeps_what_it_must(remote_uri: tuple[str, str | None], tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    remote = _remote(*remote_uri)
    remote.acquire_lease("me")
    for step in range(10, 80, 10):
        remote.upload_step(make_step(staging, step, size=1000))
    remote.store.put_bytes(remote.key("latest.json"), b'{"step": 20}')  # an operator pinned an old step
    dry = remote.gc(keep=2, milestone_every=50, dry_run=True)
    assert dry.keep == [20, 50, 60, 70] and dry.marked_now == [10, 30, 40] and dry.deleted == []
    assert remote.committed_steps() == [70, 60, 50, 40, 30, 20, 10], "dry run deletes nothing"
    first = remote.gc(keep=2, milestone_every=50, dry_run=False)
    assert first.deleted == [] and remote.committed_steps() == [70, 60, 50, 40, 30, 20, 10], "first pass only marks"
    soon = remote.gc(keep=2, milestone_every=50, dry_run=False)
    assert soon.deleted == [] and len(remote.committed_steps()) == 7, "a mark younger than the minimum age waits"
    second = remote_gc.gc(remote, keep=2, milestone_every=50, dry_run=False, min_age_s=0)
    assert second.deleted == [10, 30, 40]
    assert remote.committed_steps() == [70, 60, 50, 20]


def test_gc_never_counts_a_suspect_step_as_verified(remote_uri: tuple[str, str | None], tmp_path: Path) -> None:
    remote = _remote(*remote_uri)
    remote.acquire_lease("me")
    for step in (10, 20, 30, 40):
        remote.upload_step(make_step(tmp_path / "staging", step, size=1000))
    for _ in range(2):  # 40 and 30 poisoned: the good 20 and 10 stay, as if they were the newest
        plan = remote_gc.gc(remote, keep=2, milestone_every=0, dry_run=False, min_age_s=0, suspects=frozenset({30, 40}))
    # 40 is also kept as the step latest.json names; nothing newer than the newest good step is deleted
    assert plan.keep == [10, 20, 40] and plan.deleted == [] and remote.committed_steps() == [40, 30, 20, 10]


def test_gc_never_deletes_the_only_verified_step(remote_uri: tuple[str, str | None], tmp_path: Path) -> None:
    remote = _remote(*remote_uri)
    remote.acquire_lease("me")
    remote.upload_step(make_step(tmp_path / "staging", 10, size=1000))
    for _ in range(2):
        plan = remote.gc(keep=1, milestone_every=0, dry_run=False)
    assert plan.deleted == [] and remote.committed_steps() == [10]


# -- faults against the real server -----------------------------------------------------------


@pytest.mark.slow
def test_uploader_sigkilled_mid_upload_leaves_no_commit_and_next_run_finishes(
    s3_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    staging = tmp_path / "staging"
    make_step(staging, 10, size=24_000_000, shards=1)  # 5 multipart parts of 5 MB
    uri = f"s3://{bucket}/ckpt"
    killed = _tiering(
        *_upload_args(staging, uri, s3_endpoint, "--once", "--concurrency", "1", "--inject-fault", "kill_after_parts=2")
    )
    assert killed.returncode == -9
    remote = _remote(uri, s3_endpoint)
    assert remote.committed_steps() == [] and remote.steps().get(10, set()) - {"model/__0_0.distcp"} == set()
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads"), "the killed upload left a multipart upload"
    again = _tiering(*_upload_args(staging, uri, s3_endpoint, "--once"))
    assert again.returncode == 0 and "aborted 1 stale multipart upload" in again.stderr, again.stderr
    assert not s3.list_multipart_uploads(Bucket=bucket).get("Uploads")
    assert remote.committed_steps() == [10]
    step, _ = remote.restore_newest(RunLayout(tmp_path / "back", RUN), "r")
    assert step == 10


@pytest.mark.slow
def test_timeouts_mid_multipart_are_retried(s3_endpoint: str, bucket: str, tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    make_step(staging, 10, size=12_000_000, shards=1)
    uri = f"s3://{bucket}/ckpt"
    out = _tiering(*_upload_args(staging, uri, s3_endpoint, "--once", "--inject-fault", "timeout_parts=2"))
    assert out.returncode == 0, out.stderr
    step, rejected = _remote(uri, s3_endpoint).restore_newest(RunLayout(tmp_path / "back", RUN), "r")
    assert step == 10 and rejected == []


@pytest.mark.slow
def test_unreachable_s3_backs_off_and_training_continues(tmp_path: Path, corpus: Path) -> None:
    staging = tmp_path / "staging"
    make_step(staging, 10)
    dead = f"http://127.0.0.1:{free_port()}"
    out = _tiering(
        *_upload_args(staging, "s3://nobucket/ckpt", dead, "--watch", "--max-seconds", "5", "--retry-max-s", "4"),
        env_extra={"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"},
    )
    assert out.returncode == 0, out.stderr
    delays = [
        float(line.split("retrying in ")[1].split("s;")[0]) for line in out.stderr.splitlines() if "retrying in" in line
    ]
    ceilings = [1.0, 2.0, 4.0, 4.0, 4.0]  # capped at --retry-max-s; jitter takes up to half of each
    assert len(delays) >= 2 and all(c / 2 <= d <= c for d, c in zip(delays, ceilings)), out.stderr
    assert "staging steps pending: [10]" in out.stderr
    verify_step(staging / RUN / "steps" / "step-000000010")  # still pending, intact

    job = tmp_path / "job"
    torchrun(
        job,
        2,
        overrides_for(
            job,
            corpus,
            **{
                "train.steps": 10,
                "schedule.decay_steps": 20,  # a run of 10 steps needs a schedule past its warmup
                "checkpoint.s3.uri": "s3://nobucket/ckpt",
                "checkpoint.s3.endpoint_url": dead,
                "checkpoint.reshardable.interval": 5,
                # A store that cannot be listed may hold the run's steps: a fresh start must say it is one.
                "checkpoint.allow_fresh_start": "true",
            },
        ),
    )
    assert [e["step"] for e in events(job / "runs" / "t") if e["event"] == "save" and e["tier"] == "reshardable"] == [
        5,
        10,
    ]


# -- the trainer with the S3 tier -------------------------------------------------------------


@pytest.mark.slow
def test_tp2_checkpoint_promoted_to_s3_restores_at_tp1_dp2_after_all_local_tiers_are_lost(
    s3_endpoint: str, bucket: str, tmp_path: Path, corpus: Path
) -> None:
    """The full loop: a TP=2 job saves reshardable steps, the uploader promotes step 20 to the RGW,
    every local tier is lost, and the job resumes from S3 at TP=1/DP=2 (the probes at 2 and 1 ranks
    restore every tensor exactly; the next step's loss equals TP=2's). No file the jobs wrote and no
    output of the uploader holds the store's secret key. (This test also holds the assertions of the
    former ``test_full_loop_resumes_from_s3_after_all_local_tiers_are_lost``, whose same-topology
    job this one's jobs repeated: the restore from S3 after every local tier is lost, no leaked
    secret.)"""
    job = tmp_path / "job"
    common = {
        "checkpoint.s3.uri": f"s3://{bucket}/ckpt",
        "checkpoint.s3.endpoint_url": s3_endpoint,
        "checkpoint.reshardable.interval": 10,
        "model.hidden_dropout": 0.0,
        "model.attention_dropout": 0.0,
        "schedule.decay_steps": 40,
    }
    tp2 = overrides_for(job, corpus, **common, **{"parallel.tp": 2, "train.steps": 20})
    torchrun(job, 2, tp2)
    up = _tiering(*_upload_args(job / "reshard", f"s3://{bucket}/ckpt", s3_endpoint, "--once"))
    assert up.returncode == 0, up.stderr
    saved = full_tensors(job / "reshard" / "t" / "steps" / "step-000000020" / "model")
    # The reference next step at TP=2, then lose every local tier.
    torchrun(job, 2, [o.replace("train.steps=20", "train.steps=21") for o in tp2])
    loss_tp2 = read_jsonl(job / "runs" / "t" / "metrics.jsonl")[-1]
    secret = os.environ["AWS_SECRET_ACCESS_KEY"].encode()
    leaks = [p for p in job.rglob("*") if p.is_file() and secret in p.read_bytes()]  # before the loss
    assert not leaks and secret not in (up.stdout + up.stderr).encode(), f"secret written to {leaks}"
    subprocess.run(["rm", "-rf", str(job / "ckpt"), str(job / "reshard"), str(job / "runs")], check=True)

    for nproc in (2, 1):
        tp1 = [o for o in tp2 if not o.startswith("parallel.tp=")] + ["parallel.tp=1"]
        out = probe_restore(job, nproc, tp1)
        assert "PROBE restored=20" in out.stdout + out.stderr
        resaved = full_tensors(job / "reshard-resaved" / "t" / "steps" / "step-000000020" / "model")
        for key in saved:
            if key.startswith("optimizer.state.exp_avg") or not key.startswith("optimizer."):
                assert torch.equal(saved[key], resaved[key]), f"{key} differs after S3 restore at {nproc} rank(s)"
        subprocess.run(["rm", "-rf", str(job / "reshard-resaved"), str(job / "reshard"), str(job / "runs")], check=True)
    # Next-step loss at TP=1/DP=2 from S3 equals the TP=2 reference (up to float reduction order).
    torchrun(job, 2, [o.replace("train.steps=20", "train.steps=21") for o in tp1])
    ev = events(job / "runs" / "t")
    assert [(r["step"], r["tier"]) for r in ev if r["event"] == "restore"] == [(20, "s3")]
    loss_tp1 = read_jsonl(job / "runs" / "t" / "metrics.jsonl")[-1]
    assert loss_tp1["step"] == loss_tp2["step"] == 21
    assert abs(loss_tp1["loss"] - loss_tp2["loss"]) < 1e-5 * abs(loss_tp2["loss"])
    leaks = [p for p in job.rglob("*") if p.is_file() and secret in p.read_bytes()]
    assert not leaks, f"secret written to {leaks}"


@pytest.mark.slow
def test_trainer_refuses_a_run_owned_by_another_identity(tmp_path: Path, corpus: Path) -> None:
    uri = f"file://{tmp_path / 'objects'}"
    _remote(uri, None).acquire_lease("alice")
    job = tmp_path / "job"
    proc = torchrun(
        job,
        2,
        overrides_for(job, corpus, **{"checkpoint.s3.uri": uri, "checkpoint.s3.owner": "bob"}),
        check=False,
        timeout=200,
    )
    assert proc.returncode != 0
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if x.startswith("lease error:")]
    assert lines and "owned by 'alice'" in lines[0] and "run.json" in lines[0]
    assert not (job / "reshard").exists() or not list((job / "reshard").rglob("COMMITTED"))

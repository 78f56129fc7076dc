"""Background tier-1 saves: the committed step is the state at the save, whatever training did
afterwards; a killed or failing writer never commits and training goes on; a save due while one
is in flight waits or is skipped; retention keeps what a save or an upload still uses."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import time
import weakref
from pathlib import Path

import pytest
import torch

from pretrain.checkpointing.async_writer import BackgroundWrite, SnapshotBuffers, copy_tensors
from pretrain.checkpointing.dp_slices import SPLIT_KEY
from pretrain.commands.ft_command import ft_launcher_command
from tests.helpers import FT_CPU, TINY, events, job_env, metrics_by_step, overrides_for, torchrun
from tests.suite_cache import built_once
from tiering.digest import hash_file
from tiering.local.posix import PosixTier


@pytest.mark.parametrize("mode", ["fork", "thread"])
def test_the_written_snapshot_is_the_state_at_the_save(tmp_path: Path, mode: str) -> None:
    weights = {"w": torch.randn(1024, 512), "m": torch.zeros(1024, 512), "step": 7}  # 2 MB: copied in the background
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in weights.items()}
    buffers = SnapshotBuffers()
    for save in range(2):  # the second save reuses the thread writer's buffers
        path = tmp_path / f"state-{save}.pt"
        write = BackgroundWrite(mode, {"model": weights}, path, buffers=buffers)
        write.wait_for_snapshot()  # what the trainer does before the optimizer step
        for _ in range(20):  # training goes on and changes the tensors in place
            weights["w"].add_(1.0)
            weights["m"].mul_(0.5).add_(3.0)
        outcome = write.poll(block=True)
        assert outcome is not None and outcome.ok, outcome
        assert outcome.digest == hash_file(path), "the digest computed while writing is the file's"
        saved = torch.load(path, weights_only=True)["model"]
        assert torch.equal(saved["w"], expected["w"]) and torch.equal(saved["m"], expected["m"])
        expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in weights.items()}
    assert saved["step"] == 7


def test_a_failing_writer_reports_its_cause(tmp_path: Path) -> None:
    write = BackgroundWrite("fork", {"x": torch.ones(3)}, tmp_path / "state.pt", fault="fail")
    outcome = write.poll(block=True)
    assert outcome is not None and not outcome.ok and "injected writer failure" in outcome.error


class _UnsafeToFinalizeInAChild:
    """Stands for any object of the training process that is unsafe to finalize in a forked copy of
    it (one whose threads and locks are gone there): it kills the process that finalizes it."""

    def __init__(self, parent: int) -> None:
        self.parent = parent
        self.cycle = self  # garbage only the cyclic collector frees

    def __del__(self) -> None:
        if os.getpid() != self.parent:
            os.kill(os.getpid(), signal.SIGSEGV)


def test_a_fork_writer_never_collects_the_training_process_garbage(tmp_path: Path) -> None:
    # Many small objects: serialising them allocates enough for the child to start a collection.
    payload = {"model": {f"p{i}": torch.ones(4) for i in range(2000)}, "meta": [[i] for i in range(3000)]}
    gc.collect()
    for _ in range(50):  # the youngest garbage of the parent at the fork
        _UnsafeToFinalizeInAChild(os.getpid())
    try:
        write = BackgroundWrite("fork", payload, tmp_path / "state.pt")
        outcome = write.poll(block=True)
        assert outcome is not None and outcome.ok, outcome
        assert gc.isenabled(), "the training process collects again after the fork"
        assert torch.load(tmp_path / "state.pt", weights_only=True)["meta"][2999] == [2999]
    finally:
        gc.collect()  # the parent finalizes its own garbage, pass or fail (a later test's fork must not)


def _steps(root: Path, rank: int) -> list[int]:
    d = root / "ranks" / f"rank-{rank:05d}" / "steps"
    return sorted(int(p.name.split("-")[1]) for p in d.glob("step-*") if ".tmp" not in p.name)


IDENTICAL_STATE_RUN = {"train.steps": 20, "checkpoint.reshardable.interval": 10}


@pytest.fixture(scope="session")
def synchronous_run(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """The synchronous-save job both background modes are compared with (one for the test run, not
    per mode or per worker)."""

    def run(job: Path) -> None:
        torchrun(job, 2, overrides_for(job, corpus, **IDENTICAL_STATE_RUN, **{"checkpoint.async.enabled": "false"}))

    return built_once(tmp_path_factory, "async-synchronous-run", run)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fork", "thread"])
def test_background_and_synchronous_saves_hold_identical_state(
    tmp_path: Path, corpus: Path, synchronous_run: Path, mode: str
) -> None:
    job = tmp_path / mode
    torchrun(job, 2, overrides_for(job, corpus, **IDENTICAL_STATE_RUN, **{"checkpoint.async.mode": mode}))
    runs = {"sync": synchronous_run, mode: job}
    for rank in (0, 1):
        for step in (10, 20):
            a, b = (
                torch.load(
                    runs[n] / "ckpt" / "t" / "ranks" / f"rank-{rank:05d}" / "steps" / f"step-{step:09d}" / "state.pt",
                    weights_only=True,
                )
                for n in ("sync", mode)
            )
            am, bm = a[SPLIT_KEY], b[SPLIT_KEY]  # DP 2: each rank's half of the weights (issue 45 #10)
            assert am["layout"] == bm["layout"] and am["other"] == bm["other"] and am["dp_rank"] == bm["dp_rank"]
            assert am["buffers"].keys() == bm["buffers"].keys()
            for name, tensor in am["buffers"].items():
                assert torch.equal(tensor, bm["buffers"][name]), (rank, step, name)
            assert a["trainer"]["step"] == b["trainer"]["step"] == step
    # The reshardable (promotion staging) tier saves in the background too (Megatron's forked
    # writer): its shards and per-rank files are byte-identical to the synchronous run's.
    for step in (10, 20):
        digests = {}
        for n in ("sync", mode):
            manifest = json.loads(
                (runs[n] / "reshard" / "t" / "steps" / f"step-{step:09d}" / "manifest.json").read_text()
            )
            # trainer.pt holds the config (async on/off); DCP's .metadata a random save id.
            skip = {"trainer.pt", "model/.metadata"}
            digests[n] = {f["path"]: f["digest"] for f in manifest["files"] if f["path"] not in skip}
        assert any(p.endswith(".distcp") for p in digests["sync"]), digests["sync"]
        assert digests["sync"] == digests[mode], step
    ev = events(runs[mode] / "runs" / "t")
    for tier in ("local", "reshardable"):
        saves = [e for e in ev if e["event"] == "save" and e["tier"] == tier]
        assert [e["step"] for e in saves] == [10, 20] and all(e["blocked_seconds"] < e["seconds"] for e in saves)


@pytest.mark.slow
def test_a_killed_writer_never_commits_and_the_next_save_works(tmp_path: Path, corpus: Path) -> None:
    over = overrides_for(
        tmp_path,
        corpus,
        **{
            "train.steps": 40,
            "checkpoint.reshardable.interval": 20,
            "checkpoint.async.mode": "fork",  # a writer process to SIGKILL
            "fault_tolerance.inject.writer_fault_at_step": 20,
            "fault_tolerance.inject.writer_fault": "hang",
            "fault_tolerance.inject.staging_writer_fault": "hang",
        },
    )
    cmd = ft_launcher_command(TINY, nproc=2, ft_config=FT_CPU, max_restarts=0, overrides=over)
    with open(tmp_path / "job.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=job_env(tmp_path), cwd=tmp_path)
    run_dir = tmp_path / "runs" / "t"
    deadline = time.monotonic() + 120
    pids: dict[str, int] = {}
    while len(pids) < 2:  # rank 0's writers of tier 1 and of the staging tier (Megatron's), both made to hang
        assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "job.log").read_text()[-3000:]
        if (run_dir / "events.jsonl").exists():
            started = [e for e in events(run_dir) if e["event"] == "save_started" and e["step"] == 20]
            pids = {e["tier"]: e["writer_pid"] for e in started}
        time.sleep(0.05)
    os.kill(pids["reshardable"], signal.SIGKILL)
    time.sleep(0.5)
    os.kill(pids["local"], signal.SIGKILL)
    assert proc.wait(timeout=180) == 0, (tmp_path / "job.log").read_text()[-3000:]
    ev = events(run_dir)
    failed = [e for e in ev if e["event"] == "save_failed"]
    assert sorted((e["tier"], e["step"]) for e in failed) == [("local", 20), ("reshardable", 20)]
    assert all(e["step"] == 20 for e in failed)
    assert all("killed by signal 9" in e["error"] for e in failed), failed
    saved = [e["step"] for e in ev if e["event"] == "save" and e["tier"] == "local"]
    assert saved == [10, 30, 40], "the save after the killed one commits, and every later one"
    for rank in (0, 1):
        steps = _steps(tmp_path / "ckpt" / "t", rank)
        assert 20 not in steps and steps == [10, 30, 40], steps
        assert not list((tmp_path / "ckpt" / "t" / "ranks" / f"rank-{rank:05d}" / "steps").glob("*.tmp*"))
    resaved = [e["step"] for e in ev if e["event"] == "save" and e["tier"] == "reshardable"]
    assert resaved == [40], "the staging tier commits again after its killed writer"
    staged = sorted(p.name for p in (tmp_path / "reshard" / "t" / "steps").iterdir())
    assert staged == ["step-000000040"], staged
    assert max(metrics_by_step(run_dir)) == 40


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["wait", "skip"])
def test_a_save_due_while_one_is_in_flight(tmp_path: Path, corpus: Path, policy: str) -> None:
    over = overrides_for(
        tmp_path,
        corpus,
        **{
            "train.steps": 20,
            "checkpoint.local.interval": 5,
            "checkpoint.reshardable.interval": 1000,
            "checkpoint.async.when_busy": policy,
            # The first save is the slow one: nothing is in flight before it on any machine (a
            # later one was itself skipped once in a full suite at load 10, its predecessor's
            # write still running). Step 10 (and later ones) come due while it is in flight: 5
            # steps take a fraction of a second on an idle machine, a few seconds on a loaded one.
            "fault_tolerance.inject.writer_fault_at_step": 5,
            "fault_tolerance.inject.writer_fault": "slow",
            "fault_tolerance.inject.writer_slow_seconds": 10,
        },
    )
    torchrun(tmp_path, 2, over)
    ev = events(tmp_path / "runs" / "t")
    saved = [e["step"] for e in ev if e["event"] == "save" and e["tier"] == "local"]
    skipped = [e["step"] for e in ev if e["event"] == "save_skipped"]
    every = list(range(5, 21, 5))
    if policy == "wait":
        assert saved == every and not skipped
    else:
        assert 10 in skipped and 5 in saved and 20 in saved and not set(saved) & set(skipped)
        assert sorted(saved + skipped) == every
    assert max(metrics_by_step(tmp_path / "runs" / "t")) == 20


def test_retention_keeps_steps_in_use(tmp_path: Path) -> None:
    """keep=1: the newest committed step stays while the next one is only in flight (a temporary
    directory retention never touches); an upload's pin keeps a step past the policy."""
    from tiering.collective import SingleProcess
    from tiering.local.publish import PosixStepPublisher, manifest_for

    tier = PosixTier(tmp_path, "run", keep=1)
    pub = PosixStepPublisher(tier.layout, SingleProcess(), "a1")

    def publish(step: int) -> None:
        tmp = pub.begin(step)
        (tmp / "data.bin").write_bytes(os.urandom(1024))
        pub.commit(tmp, manifest_for("run", step, 1, {"tp": 1, "pp": 1, "dp": 1}))

    publish(10)
    in_flight = pub.begin(20)  # written in the background, not committed yet
    (in_flight / "data.bin").write_bytes(b"partial")
    assert tier.apply_retention() == [] and tier.committed_steps() == [10]
    pin = tier.pin(10, "upload")  # the uploader is still sending step 10
    pub.commit(in_flight, manifest_for("run", 20, 1, {"tp": 1, "pp": 1, "dp": 1}))
    assert tier.apply_retention() == [] and tier.committed_steps() == [20, 10]
    pin.release()
    assert tier.apply_retention() == [10] and tier.committed_steps() == [20]
    assert json.loads((tier.layout.latest_path).read_text())["step"] == 20


def test_snapshot_buffers_are_one_arena_per_dtype_reused_until_a_dtype_outgrows_its_own() -> None:
    """One allocation per dtype (not one per tensor: on a GPU host each is a cudaHostAlloc rounded
    up to a power of two), the same memory at the next save, a new arena only for a dtype whose
    tensors outgrew it; an arena reserved at start-up serves every layout that fits."""
    state = {"w": torch.randn(300, 7), "b": torch.randn(5), "m": torch.arange(10, dtype=torch.int64), "n": 3}
    buffers = SnapshotBuffers()
    first, _ = copy_tensors(state, buffers)
    assert buffers.allocations == 2 and sorted(map(str, buffers.arenas)) == ["torch.float32", "torch.int64"]
    assert buffers.arenas[torch.float32].numel() == 300 * 7 + 5  # exact size, no rounding
    assert all(torch.equal(first[k], state[k]) for k in ("w", "b", "m")) and first["n"] == 3
    pointer = first["w"].data_ptr()
    state["w"].add_(1.0)
    second, _ = copy_tensors(state, buffers)
    assert buffers.allocations == 2 and second["w"].data_ptr() == pointer  # reused, not reallocated
    assert torch.equal(second["w"], state["w"])
    state["w"] = torch.randn(301, 7)  # more fp32 elements: that arena made again, int64's kept
    third, _ = copy_tensors(state, buffers)
    assert buffers.allocations == 3 and torch.equal(third["w"], state["w"])
    state["w"] = torch.randn(20, 7)  # another layout that fits: the same arena
    fourth, _ = copy_tensors(state, buffers)
    assert buffers.allocations == 3 and torch.equal(fourth["w"], state["w"]) and torch.equal(fourth["b"], state["b"])
    reserved = SnapshotBuffers()
    reserved.reserve({torch.float32: 10_000, torch.int64: 10}, pin=False)  # at start-up, before any save
    assert reserved.allocations == 2
    state["w"] = torch.randn(300, 7)
    fifth, _ = copy_tensors(state, reserved)
    assert reserved.allocations == 2 and reserved.arenas[torch.float32].numel() == 10_000
    assert all(torch.equal(fifth[k], state[k]) for k in ("w", "b", "m"))


def test_the_thread_writer_holds_no_live_tensor_once_it_copied_them(tmp_path: Path) -> None:
    """On GPU the live tensors are a model's worth of device memory: a write that stalls (here
    slowed on purpose) or an in-process restart must not keep them alive through the writer."""
    live = torch.randn(512, 512)
    alive = weakref.ref(live)
    write = BackgroundWrite("thread", {"model": {"w": live}}, tmp_path / "state.pt", fault="slow", buffers=None)
    write.wait_for_snapshot()
    del live
    gc.collect()
    assert alive() is None, "the writer still references the live tensor after its copy"
    outcome = write.poll(block=True)
    assert outcome is not None and outcome.ok, outcome

"""The node's checkpoint agent: sealed tier-0 slots published to tier 1 outside the rank.

In one process (real slot files, real tier-1 directories, no process group): a sealed slot becomes a
verified tier-1 step; a slot rewritten while it was copied is torn and never published; retention
never deletes the floor the ranks agreed on; a full volume is reported, older steps intact. As a
process: two ranks' links share one agent, a second agent for the same run exits, an agent killed
mid-copy publishes nothing torn and the next agent persists the next request. End to end (real gloo
jobs): tier 1 through the agent resumes bit-exact after a rank is SIGKILLed, and every tier-1 step
of the run was published by the agent."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pretrain.checkpointing.agent.client import AgentLink
from pretrain.checkpointing.agent.drain import TORN, Persist, SlotDrain
from pretrain.checkpointing.agent.server import AgentSpec
from pretrain.checkpointing.agent_tier import AgentTier
from pretrain.commands.ft_command import ft_launcher_command
from pretrain.commands.status import format_status
from pretrain.errors import AgentGone
from pretrain.soak.storage import GatedMount
from tests.helpers import (
    FT_CPU,
    TINY,
    agents_serving,
    events,
    job_env,
    metrics_by_step,
    overrides_for,
    process_ended,
    read_jsonl,
    tmpfs,
    torchrun,
)
from tiering.collective import SingleProcess
from tiering.digest import HashSpec
from tiering.errors import PublishError
from tiering.local.posix import primary_store
from tiering.manifest import Manifest
from tiering.memory.slot_store import SlotStore
from tiering.verify import verify_step

RUN = "t"


def seal(root: Path, rank: int, slot: int, step: int, payload: bytes, slots: int = 3) -> SlotStore:
    """A rank's slot written and sealed as tier 0 does (chunked digests of 64 KiB)."""
    store = SlotStore(root, RUN, rank, slots)
    store.write_payload(slot, lambda fh: fh.write(payload), fresh_inode=False)
    digest = store.digest(slot, HashSpec("xxh3-128", 64 * 1024, 1))
    manifest = Manifest(RUN, step, 2, {"tp": 1, "pp": 1}, [], format="per-rank-torch/v1", extra={"owner_rank": rank})
    store.seal(slot, manifest, digest, sequence=step)
    return store


def drain_for(shm: Path, tmp: Path, keep: int = 2) -> SlotDrain:
    return SlotDrain(shm, tmp / "ckpt", RUN, slots=3, keep=keep, hash_threads=1)


def test_a_sealed_slot_becomes_a_verified_tier1_step_with_the_same_bytes(shm_dir: Path, tmp_path: Path) -> None:
    payload = os.urandom(300 * 1024 + 7)
    seal(shm_dir, 1, 2, 10, payload)
    drain = drain_for(shm_dir, tmp_path)
    assert drain.persist(Persist(rank=1, slot=2, step=10)) is None
    store = primary_store(tmp_path / "ckpt" / RUN, 1, RUN, 2)
    assert store.committed_steps() == [10]
    manifest = verify_step(store.step_path(10), expect_run_id=RUN)
    assert (store.step_path(10) / "state.pt").read_bytes() == payload
    assert manifest.extra["persisted_by"] == "agent" and "sequence" not in manifest.extra
    assert manifest.extra["owner_rank"] == 1 and manifest.world_size == 2
    assert drain.persist(Persist(rank=1, slot=2, step=10)) is None  # asked again: already there


def test_a_slot_rewritten_during_the_copy_is_torn_and_never_published(shm_dir: Path, tmp_path: Path) -> None:
    store = seal(shm_dir, 0, 0, 20, os.urandom(256 * 1024))
    with open(store.state_path(0), "r+b") as fh:  # the rank wrote the slot again under the agent
        fh.seek(100 * 1024)
        fh.write(b"\xff" * 16)
    drain = drain_for(shm_dir, tmp_path)
    error = drain.persist(Persist(rank=0, slot=0, step=20))
    assert error is not None and error.startswith(TORN) and "chunk 1" in error
    steps_dir = primary_store(tmp_path / "ckpt" / RUN, 0, RUN, 2).layout.steps_dir
    assert [p.name for p in steps_dir.iterdir()] == []  # no step, no temporary directory left
    assert drain.progress[0].failed == {20: error}


def test_a_slot_holding_another_step_is_refused(shm_dir: Path, tmp_path: Path) -> None:
    seal(shm_dir, 0, 1, 30, b"x" * 1000)
    error = drain_for(shm_dir, tmp_path).persist(Persist(rank=0, slot=1, step=40))
    assert error is not None and "holds step 30, not 40" in error


def test_retention_keeps_the_floor_every_rank_persisted_beyond_keep(shm_dir: Path, tmp_path: Path) -> None:
    """Rank 0 runs ahead of a slow rank: its keep=2 would drop step 10, the newest step the ranks
    have in common; the floor the ranks hand over keeps it until a newer common step exists."""
    drain = drain_for(shm_dir, tmp_path, keep=2)
    for step, slot in ((10, 0), (20, 1), (30, 2)):
        seal(shm_dir, 0, slot, step, os.urandom(4096))
        drain.set_floor(0, 10)
        assert drain.persist(Persist(0, slot, step)) is None
    assert drain.store(0).committed_steps() == [30, 20, 10]
    seal(shm_dir, 0, 0, 40, os.urandom(4096))
    drain.set_floor(0, 30)
    assert drain.persist(Persist(0, 0, 40)) is None
    assert drain.store(0).committed_steps() == [40, 30]


def test_before_any_floor_is_known_nothing_is_deleted(shm_dir: Path, tmp_path: Path) -> None:
    drain = drain_for(shm_dir, tmp_path, keep=2)
    for step, slot in ((10, 0), (20, 1), (30, 2)):
        seal(shm_dir, 0, slot, step, os.urandom(4096))
        assert drain.persist(Persist(0, slot, step)) is None
    assert drain.store(0).committed_steps() == [30, 20, 10]


def test_a_full_volume_is_reported_as_disk_full_and_older_steps_stay(shm_dir: Path, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "vol", 2) as vol:
        drain = SlotDrain(shm_dir, vol, RUN, slots=3, keep=2, hash_threads=1)
        seal(shm_dir, 0, 0, 10, os.urandom(700 * 1024))
        drain.set_floor(0, 10)
        assert drain.persist(Persist(0, 0, 10)) is None
        seal(shm_dir, 0, 1, 20, os.urandom(1500 * 1024))
        error = drain.persist(Persist(0, 1, 20))
        assert error is not None and error.startswith("disk_full"), error
        assert drain.store(0).committed_steps() == [10]
        verify_step(drain.store(0).step_path(10), expect_run_id=RUN)


# -- the agent process -------------------------------------------------------------------------------
def spec_for(shm: Path, tmp: Path, idle_exit_s: float = 30.0) -> AgentSpec:
    return AgentSpec(RUN, str(shm), str(tmp / "ckpt"), 3, 2, str(tmp / "runs" / RUN), idle_exit_s, 1)


def wait_for(predicate, timeout: float = 20.0) -> None:  # noqa: ANN001 - a callable returning bool
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def persisted(link: AgentLink, rank: int, step: int) -> bool:
    answer = link.request({"op": "status", "rank": rank})
    return step in answer["ranks"].get(str(rank), {}).get("persisted", [])


def _persisted_in_status(path: Path) -> dict[str, list[int]] | None:
    """The persisted steps by rank in the agent's status file, None before it is first written."""
    if not path.exists():
        return None
    return {r: v["persisted"] for r, v in json.loads(path.read_text())["ranks"].items()}


def test_two_ranks_share_one_agent_that_persists_both_and_writes_its_status(shm_dir: Path, tmp_path: Path) -> None:
    spec = spec_for(shm_dir, tmp_path)
    links = [AgentLink(spec), AgentLink(spec)]
    try:
        for rank, link in enumerate(links):
            seal(shm_dir, rank, 0, 10, os.urandom(64 * 1024))
            link.request({"op": "persist", "rank": rank, "slot": 0, "step": 10})
        pids = {link.request({"op": "status", "rank": 0})["pid"] for link in links}
        assert len(pids) == 1  # one agent for the node's run, whoever started it
        for rank, link in enumerate(links):
            wait_for(lambda r=rank, lk=link: persisted(lk, r, 10))
        # The status file follows the answers: the worker writes it after each request it finished.
        status_file = tmp_path / "runs" / RUN / "agents" / f"{os.uname().nodename}.json"
        wait_for(lambda: _persisted_in_status(status_file) == {"0": [10], "1": [10]})
        assert json.loads(status_file.read_text())["pid"] in pids
        # A second agent for the same run finds the address taken and exits at once, serving nothing.
        second = subprocess.run(
            [sys.executable, "-m", "pretrain.checkpointing.agent", "--spec", json.dumps(spec.__dict__)],
            capture_output=True,
            text=True,
            timeout=180,  # its imports (torch, via tiering.peer) take tens of seconds on a loaded machine
        )
        assert second.returncode == 0 and "another agent serves" in second.stderr
    finally:
        for link in links:
            link.close()
        _stop_agent(pids if "pids" in locals() else set())


def _stop_agent(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_an_agent_killed_mid_copy_publishes_nothing_torn_and_a_new_agent_persists_the_next_step(
    shm_dir: Path, tmp_path: Path
) -> None:
    """A 200 MB slot takes the agent a while to copy and fsync: SIGKILL it mid-copy, from outside."""
    spec = spec_for(shm_dir, tmp_path)
    link = AgentLink(spec)
    store = SlotStore(shm_dir, RUN, 0, 3)
    big = b"".join(os.urandom(1 << 20) for _ in range(200))
    seal(shm_dir, 0, 0, 10, big)
    link.request({"op": "persist", "rank": 0, "slot": 0, "step": 10})
    pid = link.request({"op": "status", "rank": 0})["pid"]
    steps_dir = primary_store(tmp_path / "ckpt" / RUN, 0, RUN, 2).layout.steps_dir
    wait_for(lambda: steps_dir.is_dir() and any(".tmp-agent-" in p.name for p in steps_dir.iterdir()))
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: process_ended(pid))
    assert [p for p in steps_dir.iterdir() if ".tmp-" not in p.name] == []  # nothing published

    seal(shm_dir, 0, 1, 20, os.urandom(64 * 1024))
    try:
        link.request({"op": "persist", "rank": 0, "slot": 1, "step": 20})  # starts a new agent
    except AgentGone:
        print((shm_dir / f"agent-{RUN}.log").read_text())  # what the agents said
        raise
    new_pid = link.request({"op": "status", "rank": 0})["pid"]
    try:
        assert new_pid != pid
        wait_for(lambda: persisted(link, 0, 20))
        assert sorted(p.name for p in steps_dir.iterdir()) == ["step-000000020"]  # the torn copy removed
        verify_step(steps_dir / "step-000000020", expect_run_id=RUN)
        assert store.view(0).step == 10  # the slot itself untouched
    finally:
        link.close()
        _stop_agent({new_pid})


def test_a_stopped_agent_costs_a_rank_one_timeout_never_a_hang(shm_dir: Path, tmp_path: Path) -> None:
    timeout_s = 0.5
    link = AgentLink(spec_for(shm_dir, tmp_path), timeout_s=timeout_s)
    pid = link.request({"op": "status", "rank": 0})["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(AgentGone, match="no answer"):
            link.request({"op": "status", "rank": 0})
        assert time.monotonic() - t0 < 10 * timeout_s  # one timeout (slack for a loaded machine), not a hang
    finally:
        os.kill(pid, signal.SIGKILL)
        link.close()


def test_an_idle_agent_exits_once_no_rank_is_connected(shm_dir: Path, tmp_path: Path) -> None:
    link = AgentLink(spec_for(shm_dir, tmp_path, idle_exit_s=0.5))
    pid = link.request({"op": "status", "rank": 0})["pid"]
    link.close()

    wait_for(lambda: process_ended(pid), timeout=10)


# -- end to end ---------------------------------------------------------------------------------------
STEPS = 24
COMMON = {
    "train.steps": STEPS,
    "schedule.decay_steps": STEPS,
    "checkpoint.local.interval": 5,
    "checkpoint.reshardable.interval": 12,
}


@pytest.mark.slow
def test_tier1_through_the_agent_publishes_every_save_and_resumes_bit_exact_from_it(
    tmp_path: Path, corpus: Path, shm_dir: Path
) -> None:
    """Two ranks, tier 0 every step and tier 1 every 5 steps through the agent, stopped at step 17
    (the final step, persisted before the run ends); the job is started again with tier 0 emptied,
    so the restore must come from what the agent published, and the resumed losses equal an
    uninterrupted run's."""
    base = tmp_path / "base"
    torchrun(base, 2, overrides_for(base, corpus, **COMMON))
    job = tmp_path / "job"
    agent = {
        "checkpoint.memory.enabled": "true",
        "checkpoint.memory.dir": str(shm_dir),
        "checkpoint.memory.slots": 3,
        "checkpoint.agent.enabled": "true",
        "checkpoint.agent.idle_exit_s": 5,
    }
    ov = overrides_for(job, corpus, **{**COMMON, "train.steps": 17}, **agent)
    torchrun(job, 2, ov)
    steps_dir = job / "ckpt" / RUN / "ranks"
    for rank in (0, 1):
        store = primary_store(job / "ckpt" / RUN, rank, RUN, 3)
        assert store.committed_steps()[0] == 17  # the final step: persisted before the run ends
        for step in store.committed_steps():
            manifest = verify_step(store.step_path(step), expect_run_id=RUN)
            assert manifest.extra["persisted_by"] == "agent", (rank, step)
    wait_for(lambda: not agents_serving(shm_dir), timeout=30)
    # The agent writes its last status after it stopped listening: wait for it, not for the socket.
    wait_for(lambda: "newest tier-1 step by rank {'0': 17, '1': 17}" in format_status(job / "runs" / RUN))
    saves = [e for e in events(job / "runs" / RUN) if e["event"] == "save" and e.get("tier") == "local"]
    assert {e["step"] for e in saves} == {5, 10, 15, 17}
    assert steps_dir.is_dir()
    subprocess.run(["rm", "-rf", str(shm_dir)], check=True)  # tier 0 gone: tier 1 must serve
    torchrun(job, 2, overrides_for(job, corpus, **COMMON, **agent))
    wait_for(lambda: not agents_serving(shm_dir), timeout=30)  # told the final step is persisted: gone
    restore = [e for e in events(job / "runs" / RUN) if e["event"] == "restore"][-1]
    assert (restore["tier"], restore["step"]) == ("local", 17), restore
    got, want = metrics_by_step(job / "runs" / RUN), metrics_by_step(base / "runs" / RUN)
    for step in range(18, STEPS + 1):
        assert got[step]["loss"] == want[step]["loss"], f"loss differs at step {step}"
    assert torch.equal(torch.tensor([got[STEPS]["grad_norm"]]), torch.tensor([want[STEPS]["grad_norm"]]))


@pytest.mark.slow
def test_a_stalled_tier1_volume_under_a_plain_ft_launcher_run_holds_the_agent_never_training(
    tmp_path: Path, corpus: Path, shm_dir: Path
) -> None:
    """The README's own-run form (``ft_launcher ... .venv/bin/pretrain train``, no standby process)
    with tier 1 on a FUSE mount whose writes block in the kernel: the gate closes once step 5 is
    in tier 1 and stays closed for 12 s. Training goes on through the stall at close to its rate
    (the agent's worker is the one held), the stall is reported, no restart happens, tier 1 comes
    back once the volume answers, and the run is bit-equal to an uninterrupted one."""
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.skip("needs /dev/fuse and root to mount a FUSE file system")
    settings = {
        "train.steps": 160,
        "schedule.decay_steps": 160,
        "checkpoint.local.interval": 5,
        "checkpoint.reshardable.interval": 80,
        "checkpoint.local.stall_timeout_s": 3.0,
        "checkpoint.memory.enabled": "true",
        "checkpoint.memory.dir": str(shm_dir),
        "checkpoint.memory.slots": 3,
        "checkpoint.agent.enabled": "true",
        "checkpoint.agent.idle_exit_s": 2,
    }
    base = tmp_path / "base"
    plain = {k: v for k, v in settings.items() if "memory" not in k and "agent" not in k}
    torchrun(base, 2, overrides_for(base, corpus, **plain))
    job, run = tmp_path / "stall", tmp_path / "stall" / "runs" / RUN
    mount = GatedMount(tmp_path / "backing", tmp_path / "mnt", tmp_path / "gate", tmp_path / "fuse.log")
    proc: subprocess.Popen[bytes] | None = None
    try:
        ov = overrides_for(job, corpus, **settings, **{"checkpoint.local.dir": str(mount.mountpoint)})
        cmd = ft_launcher_command(TINY, nproc=2, ft_config=FT_CPU, max_restarts=3, overrides=ov, standby=False)
        at = cmd.index("-m")
        cmd[at : at + 2] = [str(Path(sys.executable).with_name("pretrain"))]  # the console script
        env = job_env(job, shared_standby=False)
        with (job / "job.log").open("wb") as log:
            proc = subprocess.Popen(cmd, cwd=job, env=env, stdout=log, stderr=subprocess.STDOUT)
            wait_for(lambda: _saved(run, 5), timeout=120)
            mount.close()
            closed = (time.time(), _trained_to(run))
            time.sleep(12)
            opened = (time.time(), _trained_to(run))
            mount.open()
            assert proc.wait(timeout=180) == 0, (job / "job.log").read_text()[-4000:]
        wait_for(lambda: not agents_serving(shm_dir), timeout=30)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        mount.stop()
        _stop_agent(set(agents_serving(shm_dir)))
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("kind", "train") == "train"]
    # The fault-free rate: after the stall, with tier 1 saving again (the steps before it are the
    # first few, slowed by start-up).
    after = [r for r in rows if r["time"] >= opened[0]]
    rate = (after[-1]["step"] - after[0]["step"]) / (after[-1]["time"] - after[0]["time"])
    rate_during = (opened[1] - closed[1]) / (opened[0] - closed[0])
    print(f"steps/s during the stall {rate_during:.1f}, after it {rate:.1f} ({rate_during / rate:.0%})")
    assert rate_during >= 0.5 * rate, f"training slowed to {rate_during:.1f} from {rate:.1f} steps/s"
    ev = events(run)
    assert len({e["attempt"] for e in ev if e["event"] == "start"}) == 1, "no restart"
    stalls = [e for e in ev if e["event"] == "save_failed" and e.get("reason") == "stalled"]
    assert stalls and "checkpoint agent has been persisting" in stalls[0]["error"], stalls
    later = [e["step"] for e in ev if e["event"] == "save" and e["tier"] == "local" and e["step"] > opened[1]]
    assert later and later[-1] == 160, f"tier 1 came back once the storage answered: {later}"
    b, r = metrics_by_step(base / "runs" / RUN), metrics_by_step(run)
    assert all(r[s]["loss"] == b[s]["loss"] for s in range(1, 161)), "losses differ from the uninterrupted run"


def _saved(run: Path, step: int) -> bool:
    path = run / "events.jsonl"
    return path.exists() and any(
        e["event"] == "save" and e.get("tier") == "local" and e.get("step") == step for e in read_jsonl(path)
    )


def _trained_to(run: Path) -> int:
    path = run / "metrics.jsonl"
    return max((r.get("step", 0) for r in read_jsonl(path)), default=0) if path.exists() else 0


def test_a_step_published_with_other_bytes_is_not_taken_for_this_request(shm_dir: Path, tmp_path: Path) -> None:
    """The run resumed from an older step and saves step 20 again: the step 20 of the abandoned
    timeline, already in tier 1, is not this state; the request fails instead of answering ok."""
    drain = drain_for(shm_dir, tmp_path)
    seal(shm_dir, 0, 0, 20, os.urandom(4096))
    assert drain.persist(Persist(0, 0, 20)) is None
    assert drain.persist(Persist(0, 0, 20)) is None  # the same bytes asked again: done
    seal(shm_dir, 0, 1, 20, os.urandom(4096))  # the new timeline's step 20
    error = drain.persist(Persist(0, 1, 20))
    assert error is not None and "published with other bytes" in error


def test_a_storage_error_outside_a_copy_costs_that_request_not_the_agent(shm_dir: Path, tmp_path: Path) -> None:
    """The rank's tier-1 folder cannot be listed (a file where it belongs): the request fails with
    its reason and the agent's worker goes on to persist the next one."""
    spec = spec_for(shm_dir, tmp_path)
    link = AgentLink(spec)
    steps = primary_store(tmp_path / "ckpt" / RUN, 0, RUN, 2).layout.steps_dir
    steps.parent.mkdir(parents=True)
    steps.write_text("not a directory")
    pid = None
    try:
        seal(shm_dir, 0, 0, 10, os.urandom(4096))
        link.request({"op": "persist", "rank": 0, "slot": 0, "step": 10})
        pid = link.request({"op": "status", "rank": 0})["pid"]
        wait_for(lambda: "10" in link.request({"op": "status", "rank": 0})["ranks"].get("0", {}).get("failed", {}))
        steps.unlink()
        seal(shm_dir, 0, 1, 20, os.urandom(4096))
        link.request({"op": "persist", "rank": 0, "slot": 1, "step": 20})
        wait_for(lambda: persisted(link, 0, 20))
        assert link.request({"op": "status", "rank": 0})["pid"] == pid  # the same agent
    finally:
        link.close()
        _stop_agent({pid} if pid else set())


class SlotsOnDisk:
    """Tier 0 as the agent tier sees it (``SealedSlots``), over real slot files sealed by the test."""

    def __init__(self, root: Path) -> None:
        self.store = SlotStore(root, RUN, 0, 3)
        self.pins: frozenset[int] = frozenset()

    def sealed_slot(self, step: int) -> int | None:
        return next((v.index for v in self.store.views() if v.step == step), None)

    def sealing(self, step: int) -> bool:
        return False

    def wait_sealed(self, timeout: float) -> None:
        return None

    def pin(self, slots: frozenset[int]) -> None:
        self.pins = slots


def test_the_agent_tier_asks_again_when_the_agent_that_took_its_request_died(shm_dir: Path, tmp_path: Path) -> None:
    """The agent is SIGKILLed while it copies a 200 MB slot: the new agent knows nothing of the
    request; the tier asks it again and the save completes (before: it waited forever, every later
    tier-1 save skipped as busy). A step tier 0 does not hold is refused up front."""
    slots = SlotsOnDisk(shm_dir)
    link = AgentLink(spec_for(shm_dir, tmp_path))
    tier = AgentTier(SingleProcess(), 10, slots, link, None, 60.0, tmp_path, 99)  # type: ignore[arg-type]
    state = SimpleNamespace(step=10)  # the agent tier reads a state's step only
    seal(shm_dir, 0, 0, 10, b"".join(os.urandom(1 << 20) for _ in range(200)))
    pids: set[int] = set()
    try:
        tier.start_async(state)  # type: ignore[arg-type]
        assert tier.poll_async() is None and slots.pins == frozenset({0})  # asked; the slot is pinned
        pids.add(link.request({"op": "status", "rank": 0})["pid"])
        steps = primary_store(tmp_path / "ckpt" / RUN, 0, RUN, 2).layout.steps_dir
        wait_for(lambda: steps.is_dir() and any(".tmp-agent-" in p.name for p in steps.iterdir()))
        os.kill(next(iter(pids)), signal.SIGKILL)
        deadline = time.monotonic() + 60
        result = None
        while result is None:
            assert time.monotonic() < deadline, "the save never completed after the agent died"
            result = tier.poll_async()
            time.sleep(0.05)
        pids.add(link.request({"op": "status", "rank": 0})["pid"])
        assert result.step == 10 and len(pids) == 2 and slots.pins == frozenset()
        verify_step(steps / "step-000000010", expect_run_id=RUN)
        state.step = 20
        with pytest.raises(PublishError, match="tier 0 did not snapshot it"):
            tier.start_async(state)  # type: ignore[arg-type]
    finally:
        link.close()
        _stop_agent(pids)

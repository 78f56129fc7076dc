"""Standby rank processes: a rank forked by the standby server looks, to its launcher, exactly like
a rank that started itself (command line, environment, directory, streams, exit code, death by
signal, SIGTERM handling), dies with its client, and leaves nothing behind. Real processes: a real
server, real clients (``python -m tests.standby_rank``), real signals."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from pretrain.commands.ft_command import ft_launcher_command
from pretrain.resilience.phases import ranks_in_phase
from pretrain.resilience.standby import wire
from pretrain.resilience.standby.beside import start_server
from pretrain.resilience.standby.server import (
    NVML_SUCCESS,
    cuda_driver_loaded,
    fork_hazard,
    nvml_library,
    open_device_files,
    shut_nvml_down,
)
from pretrain.resilience.standby.wire import ENV
from pretrain.soak.storage import GatedMount  # its daemon needs fusepy; the module does not
from tests.helpers import FT_CPU, PYTHON, REPO, TINY, job_env, overrides_for

RANK = [PYTHON, "-m", "tests.standby_rank"]


@pytest.fixture(scope="module")
def server_env() -> Iterator[tuple[dict[str, str], psutil.Process]]:
    """A standby server (stopped at the end) and the environment that names it: one for the
    module, as one serves every rank start of a launcher."""
    env = {**os.environ, "STANDBY_TEST_MARKER": "m-1", "PYTHONPATH": str(REPO)}
    proc = start_server(env)
    try:
        yield env, psutil.Process(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def _client(env: dict[str, str], *action: str) -> Iterator[subprocess.Popen[str]]:
    """A client running ``action`` (and its argument), its output readable; killed on the way out."""
    client = subprocess.Popen([*RANK, *action], env=env, stdout=subprocess.PIPE, text=True)
    try:
        yield client
    finally:
        client.kill()
        client.wait()


def test_a_forked_rank_gets_the_clients_command_environment_directory_streams_and_exit_code(
    server_env: tuple[dict[str, str], psutil.Process], tmp_path: Path
) -> None:
    env, server = server_env
    done = subprocess.run([*RANK, "report", "7"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 7, done.stderr
    seen = json.loads(done.stdout)
    assert seen["ppid"] == server.pid, "the rank must be the server's fork, not the client itself"
    assert seen["argv"] == ["report", "7"] and seen["cwd"] == str(tmp_path) and seen["marker"] == "m-1"
    assert seen["agent"] == str(os.getpid()), "the rank must know the launcher (here: pytest) that started its client"
    assert "does not answer" not in done.stderr
    # What makes a restart cheap: the optimizer's Dynamo import is done, and the rank's first full
    # collection walks none of the ~350 k preloaded objects (each walk copies the shared pages).
    assert seen["dynamo_loaded"] and seen["frozen_objects"] > 100_000, seen
    # ... and the server's imports ran without the collector walking the growing heap (a second of
    # a new job's start on 2 cores).
    assert seen["full_collections_before_fork"] == 0, seen


def test_a_rank_that_dies_of_a_signal_ends_its_client_by_the_same_signal(
    server_env: tuple[dict[str, str], psutil.Process],
) -> None:
    env, _ = server_env
    done = subprocess.run([*RANK, "signal", str(int(signal.SIGSEGV))], env=env, capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGSEGV


def test_sigterm_to_the_client_is_handled_by_the_rank(server_env: tuple[dict[str, str], psutil.Process]) -> None:
    env, _ = server_env
    with _client(env, "wait-term") as client:
        assert client.stdout is not None and client.stdout.readline().startswith("ready")
        client.send_signal(signal.SIGTERM)
        out, _ = client.communicate(timeout=120)  # the rank's exit: seconds on a loaded machine
        assert client.returncode == 0 and "terminated cleanly" in out


def test_the_jobs_signals_leave_the_server_serving(server_env: tuple[dict[str, str], psutil.Process]) -> None:
    """Slurm's --signal and scancel signal every process of the step: the server too. They are the
    ranks' to handle; the server goes on forking."""
    env, server = server_env
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGHUP):
        server.send_signal(sig)
    done = subprocess.run([*RANK, "report", "5"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 5 and json.loads(done.stdout)["ppid"] == server.pid, done.stderr
    assert server.status() != psutil.STATUS_ZOMBIE


def test_a_silent_or_malformed_client_costs_its_connection_never_the_server(
    server_env: tuple[dict[str, str], psutil.Process],
) -> None:
    """A same-user process that connects and never speaks, and clients whose requests are not JSON,
    not an object, or of the wrong types: each is dropped (its passed descriptors closed), and a real
    rank start behind them is served once the silent one has timed out."""
    env, server = server_env
    silent = wire.connect(env[ENV])
    stdio = [*(os.open(os.devnull, os.O_RDWR) for _ in range(3)), os.pidfd_open(os.getpid())]
    try:
        bad_frames = [b"{not json", b"[1, 2]", json.dumps({"module": 7, "argv": [], "env": {}, "cwd": "/"}).encode()]
        for frame in bad_frames:
            with wire.connect(env[ENV]) as bad:
                socket.send_fds(bad, [frame], stdio)
                assert bad.recv(64) == b"", "the server closes a malformed request without forking"
        open_before = len(server.open_files()) + server.num_fds()
        done = subprocess.run([*RANK, "report", "3"], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 3 and "does not answer" not in done.stderr, done.stderr
        assert json.loads(done.stdout)["ppid"] == server.pid, "served by the server, after the silent client"
        assert server.is_running() and server.num_fds() <= open_before, "no descriptor of a dropped request kept"
    finally:
        silent.close()
        wire.close_all(stdio)


def test_a_killed_client_takes_its_rank_and_everything_the_rank_started(
    server_env: tuple[dict[str, str], psutil.Process],
) -> None:
    env, _ = server_env
    with _client(env, "child") as client:
        assert client.stdout is not None
        pids = json.loads(client.stdout.readline())
        client.kill()  # as the launcher's killpg(SIGKILL) would, or a fault injector
        client.wait()
        assert _gone(pids["rank"], 5), "the rank outlived its client"
        assert _gone(pids["child"], 5), "the rank's child outlived the rank's client"


@pytest.mark.parametrize("wedge", ["sigstop", "gil"])
def test_a_killed_client_takes_its_rank_even_when_the_rank_cannot_run(
    server_env: tuple[dict[str, str], psutil.Process], wedge: str
) -> None:
    """A stopped rank (SIGSTOP) or one whose GIL a thread holds cannot run its own watcher thread:
    the server ends it when the launcher kills the client (the soak's sigstop and gil faults)."""
    env, _ = server_env
    with _client(env, "gil" if wedge == "gil" else "child") as client:
        assert client.stdout is not None
        rank = json.loads(client.stdout.readline())["rank"]
        if wedge == "sigstop":
            os.kill(rank, signal.SIGSTOP)
            deadline = time.monotonic() + 5
            while psutil.Process(rank).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
                time.sleep(0.02)
            assert psutil.Process(rank).status() == psutil.STATUS_STOPPED
        else:
            time.sleep(0.5)  # the holder takes the GIL within the switch interval (5 ms)
        client.kill()
        client.wait()
        assert _gone(rank, 5), f"the {wedge} rank outlived its client"


@pytest.fixture
def stalled_mount(tmp_path: Path) -> Iterator[GatedMount]:
    """A gated FUSE mount whose gate is closed: a data write there waits in the kernel until the
    fixture opens it (and unmounts), even when the test fails."""
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.skip("needs /dev/fuse and root to mount a FUSE file system")
    pytest.importorskip("fuse", reason="fusepy missing: pip install -e '.[test]'")
    mount = GatedMount(tmp_path / "backing", tmp_path / "mnt", tmp_path / "gate", tmp_path / "fuse.log")
    try:
        mount.close()
        yield mount
    finally:
        mount.stop()


@pytest.mark.parametrize(("action", "ends"), [("stuck-write", -signal.SIGKILL), ("stuck-thread", 3)])
def test_a_rank_the_kernel_holds_after_its_end_is_reported_ended_to_its_launcher(
    server_env: tuple[dict[str, str], psutil.Process], stalled_mount: GatedMount, action: str, ends: int
) -> None:
    """A rank killed (a hang's SIGKILL from the rank monitor) or exiting while a thread waits in a
    write to storage that does not answer cannot end until the storage does: its client ends now,
    as the rank will (killed by SIGKILL, or the exit code it left with), so the launcher restarts
    the job instead of waiting on the storage."""
    env, _ = server_env
    with _client(env, action, str(stalled_mount.mountpoint / "f")) as client:
        assert client.stdout is not None
        rank = json.loads(client.stdout.readline())["rank"]
        # Until the file system's daemon holds the write (the writer waits interruptibly, S, until
        # a signal comes, then uninterruptibly, D, as a write to a hung NFS or Lustre server does).
        deadline = time.monotonic() + 30
        while "holding write to /f" not in stalled_mount.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "holding write to /f" in stalled_mount.log.read_text(), "the write never reached the daemon"
        if action == "stuck-write":
            os.kill(rank, signal.SIGKILL)  # as the rank monitor does to a hung rank
        assert client.wait(timeout=30) == ends
        assert "D" in _thread_states(rank), "the kernel still holds the rank: its launcher did not wait for it"


def _thread_states(pid: int) -> set[str]:
    """The state letter (R, S, D, Z, ...) of each thread of ``pid``; empty once it is gone."""
    states = set()
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            states.add(task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0])
    except OSError:
        pass
    return states


def test_what_an_ended_rank_left_running_is_ended_with_it(server_env: tuple[dict[str, str], psutil.Process]) -> None:
    env, _ = server_env
    done = subprocess.run([*RANK, "orphan"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert _gone(json.loads(done.stdout)["child"], 5), "a rank's leftover child must go as under the launcher"


def test_without_a_server_the_client_runs_the_rank_itself() -> None:
    env = {**os.environ, ENV: "pretrain-standby-nobody-here", "PYTHONPATH": str(REPO)}
    done = subprocess.run([*RANK, "report", "3"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3
    seen = json.loads(done.stdout)
    assert seen["ppid"] == os.getpid() and seen["agent"] is None, "the client itself must run the rank"
    assert "does not answer" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_server_that_closes_without_forking_leaves_the_rank_to_its_client() -> None:
    name = f"pretrain-standby-refusing-{os.getpid()}"
    with wire.listen(name) as listener:

        def refuse() -> None:
            conn, _ = listener.accept()
            conn.close()

        refuser = threading.Thread(target=refuse)
        refuser.start()
        env = {**os.environ, ENV: name, "PYTHONPATH": str(REPO)}
        done = subprocess.run([*RANK, "report", "4"], env=env, capture_output=True, text=True, timeout=120)
        refuser.join()
    assert done.returncode == 4 and json.loads(done.stdout)["ppid"] == os.getpid()
    assert "closed without starting the rank" in done.stderr


def test_a_server_whose_imports_started_a_thread_refuses_to_fork() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        hazard = fork_hazard()
    finally:
        stop.set()
        thread.join()
    assert hazard is not None and "thread" in hazard


def test_a_server_that_initialised_the_cuda_driver_is_unsafe_to_fork_and_one_that_only_loaded_it_is_safe() -> None:
    """No GPU here: the check reads /proc/self/maps lines as a GPU node's server would have them, and
    the driver's answer (cuDeviceGetCount: CUDA_ERROR_NOT_INITIALIZED before cuInit) is given. Triton's
    autotuner loads libcuda at import without initialising it (issue 45 #6): the server serves then."""
    gpu_maps = (
        "7f1c2a000000-7f1c2a100000 r-xp 00000000 08:01 1234 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n"
        "7f1c2b000000-7f1c2b100000 r-xp 00000000 08:01 1235 /opt/venv/torch/lib/libcudart.so.12\n"
    )
    cpu_maps = "7f1c2b000000-7f1c2b100000 r-xp 00000000 08:01 1235 /opt/venv/lib/torch/lib/libtorch_cuda.so\n"
    assert cuda_driver_loaded(gpu_maps) and not cuda_driver_loaded(cpu_maps)
    initialised = fork_hazard(gpu_maps, driver_initialised=lambda: True)
    assert initialised is not None and "cuInit" in initialised
    # (threads other tests of this pytest process started may be named instead: not CUDA)
    assert "CUDA" not in (fork_hazard(gpu_maps, driver_initialised=lambda: False) or "")
    assert "CUDA" not in (fork_hazard(cpu_maps, driver_initialised=lambda: True) or "")  # no driver mapped
    assert "CUDA" not in (fork_hazard() or ""), "this CPU machine's pytest has no CUDA driver loaded"


class _CountedNvml:
    """NVML's reference counting as its API documents it: ``nvmlInit`` adds one, ``nvmlShutdown``
    drops one (success) or answers NVML_ERROR_UNINITIALIZED (1) at none. No NVML on this machine."""

    def __init__(self, inits: int) -> None:
        self.refs = inits
        self.calls = 0

    def nvmlShutdown(self) -> int:  # noqa: N802 - NVML's name
        self.calls += 1
        if self.refs == 0:
            return 1
        self.refs -= 1
        return NVML_SUCCESS


def test_the_server_shuts_nvml_down_before_forking_and_says_what_device_files_it_holds(tmp_path: Path) -> None:
    """Issue 45 #21: torch's NVML-based CUDA check calls nvmlInit and never shuts NVML down; the
    server drops every reference (NVML closes /dev/nvidia* at the last) before its first fork. The
    library is looked for only where it is mapped (this CPU machine has none: nothing is called)."""
    nvml = _CountedNvml(inits=3)
    assert shut_nvml_down(nvml) == 3 and nvml.refs == 0 and nvml.calls == 4
    assert shut_nvml_down(_CountedNvml(inits=0)) == 0 and shut_nvml_down(None) == 0
    assert nvml_library("7f1c2b000000-7f1c2b100000 r-xp 00000000 08:01 1235 /usr/lib/libcudart.so.12\n") is None
    assert nvml_library() is None, "no NVML mapped in this CPU machine's pytest"
    held = tmp_path / "nvidiactl"
    held.write_bytes(b"")
    fd = os.open(held, os.O_RDONLY)  # a real open descriptor, as NVML's of /dev/nvidiactl would be
    try:
        assert open_device_files(str(tmp_path)) == [str(held)]
    finally:
        os.close(fd)
    assert open_device_files(str(tmp_path)) == [] and open_device_files("/dev/nvidia") == []


def test_the_preload_makes_torch_compile_lazy_and_finds_the_straggler_package_at_either_path() -> None:
    code = (
        "import sys, torch\n"
        "from pretrain.resilience.standby.server import preload\n"
        "preload()\n"
        "print(torch.compile.__name__)\n"
        "paths = ('nvidia_resiliency_ext.straggler', 'nvidia_resiliency_ext.attribution.straggler')\n"
        "print(any(m in sys.modules for m in paths))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["_compile_at_first_call", "True"]


@pytest.mark.slow  # a real 2-rank job under ft_launcher: make test, not the edit loop
def test_the_pretrain_console_script_under_ft_launcher_runs_its_ranks_as_forks_of_the_standby_server(
    tmp_path: Path, corpus: Path
) -> None:
    """``ft_launcher ... .venv/bin/pretrain train`` (the README's run of your own), not ``-m pretrain``:
    each rank the launcher starts is a fork of the standby server (its parent, its command line),
    while the launcher's worker is the console script that stands in for it. The job is ended
    once both ranks train (their pids are read from their phase records while they live)."""
    env = job_env(tmp_path, shared_standby=False)  # a server of its own: its pid is known here
    server = start_server(env)
    cmd = ft_launcher_command(TINY, nproc=2, ft_config=FT_CPU, max_restarts=0, standby=False)
    at = cmd.index("-m")
    cmd[at : at + 2] = [str(Path(PYTHON).with_name("pretrain"))]  # the console script, run by the launcher
    for item in overrides_for(tmp_path, corpus, **{"train.steps": 100000}):
        cmd += ["--set", item]
    log = (tmp_path / "job.log").open("w")
    job = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        pids = None
        while pids is None and time.monotonic() < deadline and job.poll() is None:
            pids = ranks_in_phase(tmp_path / "runs" / "t", None, "training", [0, 1])
            time.sleep(0.2)
        assert pids is not None, (tmp_path / "job.log").read_text()[-4000:]
        for pid in pids.values():
            rank = psutil.Process(pid)
            assert rank.ppid() == server.pid
            assert "pretrain.resilience.standby.server" in " ".join(rank.cmdline())
        workers = [p for p in psutil.Process(job.pid).children(recursive=True) if p.pid != server.pid]
        clients = [p for p in workers if any(a.endswith("/pretrain") for a in p.cmdline()[:3])]
        assert len(clients) == 2 and {p.pid for p in clients}.isdisjoint(pids.values())
    finally:
        # The launcher's workers run in sessions of their own: each is killed by its pid (their
        # ranks die with them, through their pidfd watch).
        for proc in [psutil.Process(job.pid), *psutil.Process(job.pid).children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        job.wait(30)
        server.kill()
        server.wait(30)
        log.close()

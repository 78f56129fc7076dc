"""The soak's runs: a fault-free baseline, the faulted run under ``ft_launcher`` with the schedule
injected from outside, and one more restart after it (the second resume).

Owns processes and waiting: launching and relaunching the job (after a job-level fault, the way
Slurm's requeue would start it again), waiting for each recovery before the next gap starts, and
collecting what happened into :class:`FaultEvent` rows. For the storage kinds it also puts the
faulted run's tier 1 on the soak's storage mount (:meth:`SoakRunner.setup_storage`, torn down by
:meth:`SoakRunner.teardown_storage`), waits for the job to record the fault, releases it and waits
for tier 1 to save again (the job never stops for them). With ``checkpoint.s3.uri`` set each run
writes under its own fresh prefix of it (:meth:`SoakRunner.setup_store`). For the store kind it
also runs the uploader beside the baseline and the faulted run (:mod:`pretrain.soak.uploader`),
the faulted run's endpoint behind the soak's proxy (:mod:`pretrain.soak.store_proxy`); it cuts
the store, waits until the uploader records a failure, keeps the store cut a while, lets it
answer again and waits until the uploader promotes a newer step. It never judges the outcome: the report
(``pretrain.soak.report``) reads the run's own records for that. Called by ``pretrain soak``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from pretrain.commands.ft_command import ft_launcher_command
from pretrain.config import Config, load_config
from pretrain.observability.runlog import read_jsonl
from pretrain.resilience.phases import read_phases
from pretrain.soak.inject import Injected, LiveRanks, inject, kill_tree, release
from pretrain.soak.schedule import KINDS, PlannedFault
from pretrain.soak.storage import StorageFaults
from pretrain.soak.store_proxy import StoreProxy
from pretrain.soak.uploader import Uploader, UploaderState

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]
FT_CONFIG = REPO / "configs" / "ft-cpu-sections.yaml"  # hangs found within a few step times
RUN_ID = "soak"
POLL_S = 0.05
SECOND_RESUME_STEPS = 3  # steps the extra restart trains after the soak's run ended (its restore is the point)
# How long the soak waits for a job that shows no sign of progress (its log does not grow), or
# for one fault's recovery: a wedged job, not a long one. A run is never cut for its length (a
# fixed 30 min cap killed the 20000-step baseline of a long soak half-way).
JOB_TIMEOUT_S = 1800.0
END_MARGIN_STEPS = 5  # no fault this close to the end: an in-rank fault needs a step to fire in
# Storage kinds: tier 1 on a tmpfs this small (the tiny job keeps ~64 MB there), and a stall
# deadline and probe interval that let a stall be recorded and cleared within seconds. 3 s was too
# tight: a save plus its replication took over 3 s on a loaded 2-core machine (a false stall), and
# 8 s too under the suite's load (two workers running storage tests): the commit and replication of
# a step after a full-disk fault took 8-9 s, every save failed as stalled until the job ended.
TIER1_VOLUME_MB = 160
STORAGE_SETTINGS = {"checkpoint.local.stall_timeout_s": 15.0, "checkpoint.local.probe_interval_s": 1.0}
# The store kind: the uploader's S3 client gives up on a request that gets no answer after one try
# of 2 s (a PUT waits 1 s more for its 100-continue; the defaults, 5 tries of 60 s, would keep one
# outage going for minutes), polls each second, backs off at most 2 s while the store is down (so
# it notices the store is back within seconds), and has a step to promote every 10 steps (staged
# by the reshardable tier).
STORE_SETTINGS = {
    "checkpoint.s3.connect_timeout_s": 1.0,
    "checkpoint.s3.read_timeout_s": 2.0,
    "checkpoint.s3.max_attempts": 1,
    "checkpoint.s3.poll_s": 1.0,
    "checkpoint.s3.retry_max_s": 2.0,
    "checkpoint.s3.interval": 10,
}
STORE_HELD_S = 2.0  # the store stays cut this long after the uploader recorded the failure
UPLOADER_WAIT_S = 300.0  # for the uploader to record a failure, or a promotion after the store answers again


@dataclass
class SoakSettings:
    config: str | None
    workdir: Path
    steps: int
    nproc: int = 2
    overrides: list[str] = field(default_factory=list)
    data: Path | None = None  # an existing indexed dataset (prefix); None: a synthetic one in the workdir


@dataclass
class FaultEvent:
    """One injected fault: the plan, the attempt it hit, what was done, when the old ranks were gone."""

    plan: PlannedFault
    attempt: str
    injected: Injected
    attempt_pids: list[int]  # every rank process of the hit attempt
    gone_at: float | None = None  # every process of the hit attempt had exited (storage kinds: the job recorded it)
    relaunched_at: float | None = None  # job-level kinds: the job started again
    recorded: dict[str, Any] | None = None  # storage kinds: the event the job recorded the fault with
    recovered_at: float | None = None  # storage kinds: tier 1 saved again; store kind: a newer step promoted
    released_at: float | None = None  # storage and store kinds: the fault undone


@dataclass
class RunTimes:
    launched_at: float
    ended_at: float
    rc: int


class Job:
    """One job: an ``ft_launcher`` process, started again after a job-level fault."""

    def __init__(self, cfg_path: Path, nproc: int, log: Path, max_restarts: int, uploader: bool = False) -> None:
        self.cfg_path = cfg_path
        self.with_uploader = uploader  # the uploader beside the job, started with it, stopped at close
        self.uploader: Uploader | None = None
        self.nproc = nproc
        self.log = log
        self.max_restarts = max_restarts
        self.proc: subprocess.Popen[bytes] | None = None
        self.tmpdirs: list[str] = []

    def start(self) -> subprocess.Popen[bytes]:
        tmp = tempfile.mkdtemp(prefix="rp-soak-", dir="/tmp")  # NVRx unix sockets: short paths
        self.tmpdirs.append(tmp)
        env = {**os.environ, "TMPDIR": tmp, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
        cmd = ft_launcher_command(self.cfg_path, nproc=self.nproc, ft_config=FT_CONFIG, max_restarts=self.max_restarts)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        if self.with_uploader and self.uploader is None:  # one uploader across relaunches, as in production
            self.uploader = Uploader(self.cfg_path, self.log.with_name("uploader.log"), env)
        return self.proc

    def wait(self, idle_s: float) -> int:
        """The job's exit code, however long it trains; TimeoutExpired once its log has not grown
        for ``idle_s`` (every attempt logs its steps, and the launcher its restarts)."""
        assert self.proc is not None
        size, changed = -1, time.monotonic()
        while True:
            try:
                return self.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                now_size = self.log.stat().st_size if self.log.exists() else 0
                if now_size != size:
                    size, changed = now_size, time.monotonic()
                elif time.monotonic() - changed > idle_s:
                    raise

    def close(self) -> None:
        """Nothing of the job outlives the soak, whatever happened."""
        if self.proc is not None and self.proc.poll() is None:
            kill_tree(self.proc)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        if self.uploader is not None:
            self.uploader.stop()
        for tmp in self.tmpdirs:
            shutil.rmtree(tmp, ignore_errors=True)


class SoakRunner:
    def __init__(self, settings: SoakSettings) -> None:
        self.s = settings
        self.work = settings.workdir
        self.total_steps = settings.steps + SECOND_RESUME_STEPS
        self.storage: StorageFaults | None = None
        self.fault_settings: dict[str, Any] = {}  # what the storage and store kinds need, in every run
        self.proxy: StoreProxy | None = None  # the store kind: between the faulted run and the store
        self.store_uri: str | None = None  # this soak's own prefix of checkpoint.s3.uri
        self.jobs: list[Job] = []  # every job started, for stop_jobs (the baseline may run on a thread)
        self.memory_root: Path | None = None  # tier 0 of this soak's runs, when the config enables it

    def stop_jobs(self) -> None:
        """The soak is leaving early (stopped, or failed): end every job it started, on any thread."""
        for job in self.jobs:
            job.close()

    def setup_storage(self) -> None:
        """The faulted run's tier 1 on the storage mount (the storage kinds); call teardown_storage."""
        self.fault_settings.update(STORAGE_SETTINGS)
        root = self.run_root("faulted")
        self.storage = StorageFaults(root, root / "ckpt-local", TIER1_VOLUME_MB)

    def teardown_storage(self) -> None:
        if self.storage is not None:
            self.storage.stop()

    def setup_store(self, cut: bool) -> None:
        """Each run under its own prefix of ``checkpoint.s3.uri`` that no earlier run wrote (a first
        attempt restores any newer step it finds in the store); ``cut`` (the store kind): the proxy
        in front of ``checkpoint.s3.endpoint_url`` for the faulted run, and the uploader beside the
        baseline and the faulted run. Call teardown_store."""
        s3 = self.loaded().checkpoint.s3
        assert s3.uri is not None
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self.store_uri = f"{s3.uri.rstrip('/')}/soak-{stamp}-{os.getpid()}"
        if cut:
            assert s3.endpoint_url  # schedule.check_request refuses the store kind without one
            self.fault_settings.update(STORE_SETTINGS)
            self.proxy = StoreProxy(s3.endpoint_url)

    def teardown_store(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()

    def setup_memory(self) -> None:
        """Tier 0 (``checkpoint.memory``), when enabled: each run under its own directory of the
        configured tmpfs, new to this soak (the baseline beside the faulted run would otherwise
        share slots, and an earlier soak's slots of the same run id would be restored at the first
        start). Call teardown_memory."""
        memory = self.loaded().checkpoint.memory
        if memory.enabled:
            self.memory_root = Path(memory.dir) / f"soak-{os.getpid()}-{time.monotonic_ns()}"

    def teardown_memory(self) -> None:
        if self.memory_root is not None:
            shutil.rmtree(self.memory_root, ignore_errors=True)

    def _store_items(self, name: str) -> list[str]:
        """The run's own prefix, and with the proxy the run's endpoint (the proxy for the faulted
        run); after the user's overrides: these must win."""
        if self.store_uri is None:
            return []
        items = [f"checkpoint.s3.uri={self.store_uri}/{name}"]
        if self.proxy is not None:
            items.append(f"checkpoint.s3.endpoint_url={self.proxy.url if name == 'faulted' else self.proxy.upstream}")
        return items

    # -- configuration --------------------------------------------------------------------------
    def run_root(self, name: str) -> Path:
        return self.work / name

    def run_dir(self, name: str) -> Path:
        return self.work / name / "runs" / RUN_ID

    def config(self, name: str, steps: int) -> Path:
        root = self.run_root(name)
        settings = {
            "run.dir": root / "runs",
            "run.id": RUN_ID,
            "data.prefix": self.data_prefix,
            "checkpoint.local.dir": root / "ckpt-local",
            "checkpoint.reshardable.dir": root / "ckpt-reshardable",
            "train.steps": steps,
            "schedule.decay_steps": self.total_steps,  # one LR schedule for every run, as in one long run
            "metrics.enabled": "false",
            # one machine stands for every node here: the replica shares its failure domain
            "checkpoint.replication.allow_same_domain": "true",
            "fault_tolerance.inject.trigger_dir": root / "triggers",
            **self.fault_settings,
        }
        items = [f"{k}={v}" for k, v in settings.items()] + list(self.s.overrides) + self._store_items(name)
        if self.memory_root is not None:  # after the user's overrides: it must win
            items.append(f"checkpoint.memory.dir={self.memory_root / name}")
        cfg = load_config(self.s.config, items)
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(root / "triggers", ignore_errors=True)  # a request no rank read must not fire in the next run
        path = root / f"config-{steps}.yaml"
        path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return path

    def loaded(self) -> Config:
        return load_config(self.s.config, list(self.s.overrides))

    @property
    def data_prefix(self) -> Path:
        return self.s.data if self.s.data is not None else self.work / "data" / "corpus"

    def prepare_data(self) -> None:
        """A 1 MB synthetic corpus in the workdir, unless the soak was given one (``--data``)."""
        if self.s.data is not None:
            return
        cmd = [sys.executable, "-m", "pretrain", "prepare-data", "--synthetic-mb", "1"]
        cmd += ["--output", str(self.work / "data" / "corpus")]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONWARNINGS": "ignore"})

    # -- runs -----------------------------------------------------------------------------------
    def plain_run(self, name: str, steps: int, log_name: str, uploader: bool = False) -> RunTimes:
        """A job without faults (the baseline, the second resume), to its end; ``uploader``: with the
        uploader beside it when the soak has a store kind (the baseline: the faulted run has one)."""
        cfg_path = self.config(name, steps)
        log = self.run_root(name) / log_name
        job = Job(cfg_path, self.s.nproc, log, max_restarts=2, uploader=uploader and self.proxy is not None)
        self.jobs.append(job)
        t0 = time.time()
        try:
            job.start()
            rc = job.wait(JOB_TIMEOUT_S)
        finally:
            job.close()
        return RunTimes(t0, time.time(), rc)

    def faulted_run(self, schedule: list[PlannedFault]) -> tuple[RunTimes, list[FaultEvent], str | None]:
        """The soak's run: every planned fault, each after the previous recovery plus its gap.
        Returns the run's times, the faults injected and why injection stopped early (or None)."""
        name = "faulted"
        cfg_path = self.config(name, self.s.steps)
        log = self.run_root(name) / "job.log"
        job = Job(cfg_path, self.s.nproc, log, max_restarts=len(schedule) + 2, uploader=self.proxy is not None)
        self.jobs.append(job)
        events: list[FaultEvent] = []
        stopped: str | None = None
        t0 = time.time()
        try:
            job.start()
            hit: str | None = None
            for plan in schedule:
                live, why = self._recovered(job, hit, events[-1] if events else None)
                if live is None:
                    stopped = why
                    break
                attempt = self._wait_gap(job, plan, live.attempt)
                if attempt is None:
                    stopped = f"the job ended before fault {plan.index + 1} ({plan.kind}) was due"
                    break
                if self._last_step() >= self.s.steps - END_MARGIN_STEPS:
                    stopped = f"the job was about to end before fault {plan.index + 1} ({plan.kind}) was due"
                    break
                live = self._live(attempt) or live  # the pids as they are now
                event = self._fault(job, plan, live)
                events.append(event)
                if not KINDS[plan.kind].restarts:  # the job goes on: no new attempt
                    continue
                hit = live.attempt
                if KINDS[plan.kind].target == "job":
                    job.wait(JOB_TIMEOUT_S)
                    event.gone_at = _gone_at(event.attempt_pids) or time.time()
                    job.start()  # as Slurm's requeue would
                    event.relaunched_at = time.time()
            if events and events[-1].gone_at is None:
                self._recovered(job, hit, events[-1])
            rc = job.wait(JOB_TIMEOUT_S)
        finally:
            job.close()
        return RunTimes(t0, time.time(), rc), events, stopped

    def _fault(self, job: Job, plan: PlannedFault, live: LiveRanks) -> FaultEvent:
        """Inject ``plan`` into the live attempt; for a storage or store kind, also follow it to its
        recovery (the job does not stop for those)."""
        target = KINDS[plan.kind].target
        before = self._uploader_before(job) if target == "store" else None
        assert job.proc is not None
        root = self.run_root("faulted")
        done = inject(
            plan.kind, plan.rank, live, job.proc, root / "triggers", root / "ckpt-local" / RUN_ID, plan.index,
            time.time(), self.storage, self.proxy,
        )  # fmt: skip
        event = FaultEvent(plan, live.attempt, done, sorted(live.pids.values()))
        if target == "storage":
            self._storage_recovery(job, event)
        elif target == "store":
            self._store_recovery(job, event, before)
        return event

    def _uploader_before(self, job: Job) -> UploaderState | None:
        """What the uploader had recorded just before the store is cut (its metrics page)."""
        assert job.uploader is not None  # a soak with the store kind runs one beside the faulted run
        return job.uploader.wait_read(UPLOADER_WAIT_S)

    def _store_recovery(self, job: Job, event: FaultEvent, before: UploaderState | None) -> None:
        """The store kind: wait until the uploader records a failed promotion, keep the store cut
        ``STORE_HELD_S`` more, let it answer again, and wait until the uploader promotes a step newer
        than the one it had when the store was cut (``before``; None: its metrics never answered,
        the store answers again at once and the fault stays unrecorded)."""
        up = job.uploader
        if up is None or before is None:
            event.injected.detail.update(release(event.plan.kind, None, self.proxy))
            event.released_at = time.time()
            return
        try:
            failed = up.wait_for(lambda s: s.store_failures > before.store_failures, UPLOADER_WAIT_S)
            if failed is not None:
                event.gone_at = failed.time
                event.recorded = {
                    "reason": "store",
                    "uploader_failures_total": [before.store_failures, failed.store_failures],
                    "promoted_step_at_fault": before.promoted_step,
                    "time": failed.time,
                }
                time.sleep(STORE_HELD_S)
        finally:
            event.injected.detail.update(release(event.plan.kind, None, self.proxy))
        event.released_at = time.time()
        last = before.promoted_step if before.promoted_step is not None else -1
        newer = up.wait_for(lambda s: s.promoted_step is not None and s.promoted_step > last, UPLOADER_WAIT_S)
        if newer is not None:
            event.recovered_at = newer.promoted_at or newer.time
            if event.recorded is not None:
                event.recorded["promoted_step_after"] = newer.promoted_step

    def _storage_recovery(self, job: Job, event: FaultEvent) -> None:
        """A storage fault: wait until the job records it (a tier-1 save failed or skipped with the
        kind's reason), release it, and wait until tier 1 saves again (or the job ends)."""
        kind, t = KINDS[event.plan.kind], event.injected.time
        try:
            event.recorded = self._wait_event(
                job, lambda e: e.get("tier") == "local" and e.get("reason") == kind.expect and e["time"] > t
            )
            event.gone_at = event.recorded["time"] if event.recorded else None
        finally:
            release(event.plan.kind, self.storage)
        released = event.released_at = time.time()
        saved = self._wait_event(
            job, lambda e: e["event"] == "save" and e.get("tier") == "local" and e["time"] > released
        )
        event.recovered_at = saved["time"] if saved else None

    def _wait_event(self, job: Job, match: Any) -> dict[str, Any] | None:
        """The first event of the faulted run that ``match`` accepts; None if the job ended first."""
        path = self.run_dir("faulted") / "events.jsonl"
        deadline = time.time() + JOB_TIMEOUT_S
        while time.time() < deadline:
            found = next((e for e in read_jsonl(path) if match(e)), None) if path.exists() else None
            if found is not None:
                return found
            assert job.proc is not None
            if job.proc.poll() is not None:
                return None
            time.sleep(POLL_S)
        return None

    def _last_step(self) -> int:
        rows = read_metrics(self.run_dir("faulted"))
        return max((r["step"] for r in rows[-5:]), default=0)

    # -- waiting on the job's own records -------------------------------------------------------
    def _live(self, attempt: str | None = None) -> LiveRanks | None:
        """Every rank of one attempt in training (its first step done), alive; None otherwise."""
        recs = read_phases(self.run_dir("faulted"))
        if len(recs) < self.s.nproc:
            return None
        attempts = {rec.get("attempt") for rec in recs.values()}
        if len(attempts) != 1 or any(rec.get("phase") != "training" for rec in recs.values()):
            return None
        found = attempts.pop()
        if found is None or (attempt is not None and found != attempt):
            return None
        pids = {r: int(rec["pid"]) for r, rec in recs.items()}
        if not all(psutil.pid_exists(p) for p in pids.values()):
            return None
        return LiveRanks(found, pids, {r: str(rec.get("host")) for r, rec in recs.items()})

    def _recovered(self, job: Job, hit: str | None, last: FaultEvent | None) -> tuple[LiveRanks | None, str]:
        """Wait until an attempt other than ``hit`` is training (a new attempt reached a step),
        noting when the hit attempt's processes were all gone."""
        deadline = time.time() + JOB_TIMEOUT_S
        while time.time() < deadline:
            if last is not None and last.gone_at is None:
                last.gone_at = _gone_at(last.attempt_pids)
            live = self._live()
            if live is not None and live.attempt != hit:
                if last is not None and last.gone_at is None:
                    last.gone_at = time.time()
                return live, ""
            assert job.proc is not None
            if job.proc.poll() is not None:
                return None, f"the job ended (exit {job.proc.returncode}) before a new attempt trained"
            time.sleep(POLL_S)
        return None, f"no attempt trained for {JOB_TIMEOUT_S:.0f} s"

    def _wait_gap(self, job: Job, plan: PlannedFault, attempt: str) -> str | None:
        """The planned gap after a recovery: seconds, or steps trained. Returns the attempt that
        trains at its end (None: the job ended first). An attempt that restarted without a fault
        (a false hang on a loaded machine, say) is followed, not waited on: the report names it
        among the unplanned restarts, from the attempt records."""
        if plan.gap_steps is None:
            return attempt if self._sleep_unless_ended(job, plan.gap_s) else None
        # steps this attempt trained after its first one (rows of the attempt it replaced come first)
        while sum(r["attempt"] == attempt for r in read_metrics(self.run_dir("faulted"))) <= plan.gap_steps:
            assert job.proc is not None
            if job.proc.poll() is not None:
                return None
            newer = self._live()
            if newer is not None and newer.attempt != attempt:
                log.warning("soak: attempt %s restarted without a fault; %s trains now", attempt, newer.attempt)
                attempt = newer.attempt
            time.sleep(POLL_S)
        return attempt

    @staticmethod
    def _sleep_unless_ended(job: Job, seconds: float) -> bool:
        end = time.time() + seconds
        while time.time() < end:
            assert job.proc is not None
            if job.proc.poll() is not None:
                return False
            time.sleep(POLL_S)
        return True


def _gone_at(pids: list[int]) -> float | None:
    """Now, if none of ``pids`` is left (killed or exited; a zombie counts as gone)."""
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return None
    return time.time()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Training rows of ``metrics.jsonl`` (validation rows left out), in the order written."""
    return [m for m in read_jsonl(run_dir / "metrics.jsonl") if m.get("kind") != "validation"]


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")

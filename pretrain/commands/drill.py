"""``pretrain drill``: a minimal, reproducible recovery experiment, automated at CPU scale.

A training job is killed, recovers from its checkpoints and is compared, step for step, with the
same job run without a fault; then damaged checkpoints and repeated failures are thrown at it:

1. an uninterrupted baseline (fixed data snapshot, seed, world size) to step 150, the last step a
   recovered run is compared with (its LR schedule is the whole drill's);
2. the same run saving every 50 steps, rank 1 SIGKILLed at step 135; rank 0 of the restarted
   group SIGKILLed by the drill while it loads step 100 (a second fault during recovery) -> the
   third attempt recovers step 100 (data watermark as in the manifest) and matches the baseline's
   loss, grad norm and LR; no process of the old worlds survives;
3. a restart after step 150 loads step 150;
4. a step-200 copy without COMMITTED and one without a shard (own copy, its replica and the
   reshardable tier) -> all rejected, recovery from 150;
5. three consecutive failures -> the job stops and says why;
6. tier 0 (every step's state in host memory) on a fresh run, rank 1 SIGKILLed at step 43, before
   tier 1 holds anything -> restored from tier 0 with at most one step lost, matching the baseline.

Writes ``drill-report.json``, ``drill-report.md`` and ``drill-loss.png`` under the work directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from pretrain.checkpointing.agent.client import AgentLink, spec_for
from pretrain.commands.demo import FT_CONFIG, memory_dir
from pretrain.commands.ft_command import ft_launcher_command
from pretrain.config import load_config
from pretrain.errors import AgentGone
from pretrain.observability.goodput import format_goodput, goodput_from_records
from pretrain.resilience.outside_faults import Fault, PhaseKiller
from pretrain.resilience.phases import read_phases
from pretrain.resilience.standby.beside import with_standby

SAVE_EVERY, KILL_AT, TOTAL = 50, 135, 220
COMPARED_TO = 150  # the first drill run ends here; later phases check restores, not losses
TIER0_KILL_AT, TIER0_STEPS = 43, 60  # before tier 1's first save (step 50): only tier 0 holds a step


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class DrillReport:
    checks: list[Check] = field(default_factory=list)
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    save_seconds: dict[str, list[float]] = field(default_factory=dict)
    load_seconds: list[dict[str, Any]] = field(default_factory=list)
    wall_seconds: float = 0.0

    def check(self, name: str, passed: bool, detail: str) -> bool:
        self.checks.append(Check(name, bool(passed), detail))
        print(f"[drill] {'PASS' if passed else 'FAIL'} {name}: {detail}", flush=True)
        return bool(passed)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)


class Drill:
    def __init__(self, config: str | None, workdir: Path) -> None:
        self.work = workdir
        self.config = config
        self.env = {
            **os.environ,
            "TMPDIR": tempfile.mkdtemp(prefix="rp-drill-", dir="/tmp"),  # NVRx unix sockets: short paths
            "PYTHONWARNINGS": "ignore",
            "OMP_NUM_THREADS": "1",
        }
        self.report = DrillReport()

    # -- plumbing -------------------------------------------------------------------------------
    def _config(self, run_id: str, **extra: Any) -> Path:
        w = self.work
        settings = {
            "run.dir": w / "runs",
            "run.id": run_id,
            "data.prefix": w / "data" / "corpus",
            "checkpoint.local.dir": w / "ckpt-local",
            "checkpoint.reshardable.dir": w / "ckpt-reshardable",
            "checkpoint.local.interval": SAVE_EVERY,
            "checkpoint.local.keep": 3,
            "checkpoint.reshardable.interval": 100,
            "checkpoint.reshardable.keep": 2,
            "checkpoint.replication.allow_same_domain": "true",
            # Checks 2-5 are of the disk tiers (what a restart finds there, and what it rejects):
            # tier 0, on by default where the tmpfs holds it, would restore the newest step from
            # memory first. Check 6 turns it on.
            "checkpoint.memory.enabled": "false",
            "schedule.decay_steps": TOTAL,  # one LR schedule for every phase, as in one long run
            "metrics.enabled": "false",
            **extra,
        }
        cfg = load_config(self.config, [f"{k}={v}" for k, v in settings.items()])
        path = w / f"config-{run_id}-{len(list(w.glob('config-*')))}.yaml"
        path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return path

    def _run(self, cmd: list[str], name: str) -> int:
        with open(self.work / f"{name}.log", "w") as log:
            return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, timeout=600).returncode

    def _torchrun(self, cfg: Path, name: str) -> int:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        return self._run(with_standby([*cmd, "-m", "pretrain", "train", "--config", str(cfg)]), name)

    def _ft_launch(self, cfg: Path, name: str, max_restarts: int) -> int:
        ft = self.work / "ft.yaml"
        ft.write_text(yaml.safe_dump(FT_CONFIG))
        return self._run(ft_launcher_command(cfg, nproc=2, ft_config=ft, max_restarts=max_restarts), name)

    def _jsonl(self, run_id: str, name: str) -> list[dict[str, Any]]:
        path = self.work / "runs" / run_id / name
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []

    def _attempts(self, run_id: str) -> list[dict[str, Any]]:
        d = self.work / "runs" / run_id / "attempts"
        return [json.loads(p.read_text()) for p in sorted(d.glob("attempt-*.json"))]

    def _restores(self, run_id: str) -> list[dict[str, Any]]:
        return [e for e in self._jsonl(run_id, "events.jsonl") if e["event"] == "restore"]

    def _orphans(self, cfg: Path, run_id: str) -> list[str]:
        """``PID command line`` of every live process started with ``cfg`` (this process excluded),
        and of every rank process the run's phase records name (a rank forked by the standby
        process has the standby's command line, not ``cfg``)."""
        ranks = {int(rec["pid"]) for rec in read_phases(self.work / "runs" / run_id).values()}
        out = []
        for proc in psutil.process_iter(["pid", "cmdline", "status"]):
            cmdline = " ".join(proc.info["cmdline"] or [])  # None: not readable, or a kernel thread
            alive = proc.info["status"] != psutil.STATUS_ZOMBIE
            if alive and (str(cfg) in cmdline or proc.info["pid"] in ranks) and proc.info["pid"] != os.getpid():
                out.append(f"{proc.info['pid']} {cmdline}")
        return out

    # -- phases ---------------------------------------------------------------------------------
    def run(self) -> DrillReport:
        t0 = time.perf_counter()
        rep = self.report
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pretrain",
                "prepare-data",
                "--synthetic-mb",
                "1",
                "--output",
                str(self.work / "data" / "corpus"),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            env=self.env,
        )
        try:
            base = self._baseline()
            self._kill_and_recover(base)
            self._restart_after_150()
            self._bad_step_200()
            attempts = self._three_failures()
            self._collect_numbers(attempts)
            self._tier0_kill(base)
        finally:
            self._release_agents()
        rep.wall_seconds = time.perf_counter() - t0
        return rep

    def _release_agents(self) -> None:
        """The node agents of the drill's runs leave now, not after their idle exit: a run that
        ended in a failure (checks 5 and 6) never told its agent it was done."""
        released: set[str] = set()
        for path in sorted(self.work.glob("config-*.yaml")):
            cfg = load_config(str(path))
            link = AgentLink(spec_for(cfg.run, cfg.checkpoint, cfg.fault_tolerance.hang_watch_s), start=False)
            if link.spec.name in released:
                continue
            released.add(link.spec.name)
            with contextlib.suppress(AgentGone):  # none listens: nothing to release
                link.request({"op": "finish"})
            link.close()

    def _baseline(self) -> dict[int, dict[str, Any]]:
        """1. the uninterrupted baseline."""
        rep = self.report
        # It saves only its last step (what a step computes does not depend on the saves): its
        # losses are what the recovered runs are compared with, up to the last step any of them is.
        settings = {"checkpoint.local.interval": COMPARED_TO, "checkpoint.reshardable.enabled": "false"}
        base_cfg = self._config("baseline", **{"train.steps": COMPARED_TO, **settings})
        rc = self._torchrun(base_cfg, "1-baseline")
        base = {m["step"]: m for m in self._jsonl("baseline", "metrics.jsonl")}
        rep.check("baseline", rc == 0 and max(base, default=0) == COMPARED_TO, f"{len(base)} steps, exit {rc}")
        return base

    def _kill_and_recover(self, base: dict[int, dict[str, Any]]) -> None:
        """2. kill at step 135, a second kill while the restarted group loads -> recover step 100,
        match the baseline."""
        rep = self.report
        cfg2 = self._config(
            "drill",
            **{
                "train.steps": COMPARED_TO,
                "fault_tolerance.inject.kill_rank": 1,
                "fault_tolerance.inject.kill_at_step": KILL_AT,
                # the restarted group holds 2 s in "load": the drill's SIGKILL lands inside it
                "fault_tolerance.inject.hold_at": "1:load",
                "fault_tolerance.inject.hold_seconds": 2,
            },
        )
        fault = Fault(restart=1, phase="load", ranks=[0])
        killer = PhaseKiller(self.work / "runs" / "drill", [fault], timeout=300)
        killer.start()
        rc = self._ft_launch(cfg2, "2-kill-at-135", max_restarts=3)
        killer.stop()
        killer.join(timeout=5)
        killed = fault.done.get("pids", {})
        restores = self._restores("drill")
        got = [(r["step"], r["tier"]) for r in restores]
        attempts = self._attempts("drill")
        rep.check(
            "recover-from-100",
            rc == 0 and got == [(100, "local")] and len(attempts) == 3,
            f"restores {got} in {len(attempts)} attempts (a failure, a failure during its recovery, a recovery), "
            f"exit {rc}",
        )
        second = (attempts[1].get("failure") or {}) if len(attempts) > 1 else {}
        rep.check(
            "recover-after-a-kill-during-recovery",
            rc == 0 and 0 in killed and second.get("phases") == {"0": "load"},
            f"rank 0 (pid {killed.get(0)}) SIGKILLed while loading step 100 in the second attempt; its record: "
            f"{second.get('evidence')}; the third attempt restored {got[-1] if got else None}",
        )
        orphans = self._orphans(cfg2, "drill")
        rep.check("no-orphans", not orphans, f"leftover processes: {orphans or 'none'}")
        self._check_matches(base, restores, cfg2)

    def _check_matches(self, base: dict[int, dict[str, Any]], restores: list[dict[str, Any]], cfg2: Path) -> None:
        rep = self.report
        drill = {m["step"]: m for m in self._jsonl("drill", "metrics.jsonl")}
        first_new = [
            m for m in self._jsonl("drill", "metrics.jsonl") if restores and m["attempt"] == restores[0]["attempt"]
        ]
        gbs = load_config(cfg2).data.global_batch_size
        watermark_ok = bool(first_new) and first_new[0]["step"] == 101 and first_new[0]["consumed_samples"] == 101 * gbs
        manifest = self._manifest("drill", 0, 100)
        after = (first_new[0]["step"], first_new[0]["consumed_samples"]) if first_new else (None, None)
        rep.check(
            "data-watermark",
            watermark_ok and manifest.get("consumed_samples") == 100 * gbs,
            f"manifest step 100 consumed_samples={manifest.get('consumed_samples')}; first step after the restore "
            f"{after[0]} with consumed_samples={after[1]}",
        )
        window = range(101, COMPARED_TO + 1)
        diffs = [s for s in window if s not in drill or s not in base or _differs(drill[s], base[s])]
        rep.check(
            "matches-baseline",
            not diffs,
            f"loss, grad norm and LR of steps {window.start}-{window.stop - 1} ({len(window)} steps) "
            + ("equal the baseline bit for bit" if not diffs else f"differ at {diffs[:5]}"),
        )

    def _restart_after_150(self) -> None:
        """3. a restart after step 150 loads step 150."""
        rep = self.report
        cfg3 = self._config("drill", **{"train.steps": 200})
        rc = self._torchrun(cfg3, "3-restart-after-150")
        got = [(r["step"], r["tier"]) for r in self._restores("drill")][1:]
        rep.check("step-150-loads", rc == 0 and got == [(150, "local")], f"restores {got}, exit {rc}")

    def _bad_step_200(self) -> None:
        """4. step 200 damaged in every copy -> rejected, recovery from 150."""
        rep = self.report
        damaged = self._damage_step_200()
        cfg4 = self._config("drill", **{"train.steps": 210})
        rc = self._torchrun(cfg4, "4-bad-step-200")
        last = self._restores("drill")[-1]
        rejected = [r["reason"] for r in last.get("rejected", []) if r["step"] == 200]
        quarantined = sorted(
            str(p.relative_to(self.work))
            for p in self.work.glob("ckpt-*/drill/**/quarantine/step-000000200.*.reason.txt")
        )
        rep.check(
            "reject-200-fallback-150",
            rc == 0 and last["step"] == 150 and len(rejected) >= 2 and len(quarantined) >= 3,
            f"damaged {damaged}; restored {last['step']} from {last['tier']}; rejected {len(rejected)} copies "
            f"({'; '.join(r[:160] for r in rejected)}); quarantined {quarantined}",
        )

    def _three_failures(self) -> list[dict[str, Any]]:
        """5. three consecutive identical failures -> the job stops and says so."""
        rep = self.report
        cfg5 = self._config(
            "drill",
            **{
                "train.steps": 260,
                "fault_tolerance.inject.kill_rank": 1,
                "fault_tolerance.inject.kill_at_step": 215,
                "fault_tolerance.inject.every_attempt": "true",
            },
        )
        rc = self._ft_launch(cfg5, "5-three-failures", max_restarts=6)
        attempts = self._attempts("drill")
        stop = self.work / "runs" / "drill" / "attempts" / "STOP.json"
        tail = [a["status"] for a in attempts[-4:]]
        rep.check(
            "stops-after-3-failures",
            rc != 0 and stop.exists() and tail == ["failed", "failed", "failed", "stopped"],
            f"last attempts {tail}; {json.loads(stop.read_text())['reason'] if stop.exists() else 'no STOP.json'}",
        )
        return attempts

    def _tier0_kill(self, base: dict[int, dict[str, Any]]) -> None:
        """6. tier 0 every step, a kill before tier 1's first save -> at most one step lost."""
        memory = memory_dir(self.work, "drill")
        cfg6 = self._config(
            "drill-tier0",
            **{
                "train.steps": TIER0_STEPS,
                "checkpoint.memory.enabled": "true",
                "checkpoint.memory.dir": memory,
                "fault_tolerance.inject.kill_rank": 1,
                "fault_tolerance.inject.kill_at_step": TIER0_KILL_AT,
            },
        )
        try:
            rc = self._ft_launch(cfg6, "6-tier0-kill", max_restarts=2)
        finally:
            shutil.rmtree(memory, ignore_errors=True)  # tmpfs is memory: give it back
        got = [(r["step"], r["tier"]) for r in self._restores("drill-tier0")]
        recovered = [a for a in self._attempts("drill-tier0") if a.get("restored") is not None]
        lost = recovered[0].get("lost_steps") if recovered else None
        rows = {m["step"]: m for m in self._jsonl("drill-tier0", "metrics.jsonl")}
        after = range(got[0][0] + 1, TIER0_STEPS + 1) if got else range(0)
        diffs = [s for s in after if s not in rows or s not in base or _differs(rows[s], base[s])]
        compared = "equal the baseline bit for bit" if not diffs else f"differ at {diffs[:5]}"
        self.report.check(
            "tier0-loses-at-most-one-step",
            rc == 0 and len(got) == 1 and got[0][1] == "memory" and lost is not None and lost <= 1 and not diffs,
            f"rank 1 killed at step {TIER0_KILL_AT}; restores {got}; lost steps {lost}; "
            f"steps {after.start}-{after.stop - 1} {compared}; exit {rc}",
        )
        self.report.recoveries += [_recovery_row(a) for a in recovered]

    def _manifest(self, run_id: str, rank: int, step: int) -> dict[str, Any]:
        path = (
            self.work
            / "ckpt-local"
            / run_id
            / "ranks"
            / f"rank-{rank:05d}"
            / "steps"
            / f"step-{step:09d}"
            / "manifest.json"
        )
        if not path.exists():  # quarantined or retired since: look in the reshardable tier
            path = self.work / "ckpt-reshardable" / run_id / "steps" / f"step-{step:09d}" / "manifest.json"
        try:
            manifest = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        return {**manifest.get("extra", {}), **manifest}

    def _damage_step_200(self) -> list[str]:
        root = self.work / "ckpt-local" / "drill"
        step = "step-000000200"
        damaged = []
        own = root / "ranks" / "rank-00001" / "steps" / step / "COMMITTED"
        own.unlink()
        damaged.append(f"{own.parent.relative_to(self.work)} without COMMITTED")
        replica = next((root / "replicas").glob(f"rank-00001/steps/{step}"), None)
        if replica is not None:
            (replica / "state.pt").unlink()
            damaged.append(f"{replica.relative_to(self.work)} without its shard state.pt")
        resh = self.work / "ckpt-reshardable" / "drill" / "steps" / step
        shard = sorted(p for p in (resh / "model").iterdir() if p.suffix == ".distcp")[0]
        shard.unlink()
        damaged.append(f"{resh.relative_to(self.work)} without shard {shard.name}")
        return damaged

    def _collect_numbers(self, attempts: list[dict[str, Any]]) -> None:
        rep = self.report
        for e in self._jsonl("drill", "events.jsonl"):
            if e["event"] == "save":
                rep.save_seconds.setdefault(e["tier"], []).append(round(e["seconds"], 4))
            if e["event"] == "restore":
                rep.load_seconds.append({"step": e["step"], "tier": e["tier"], "seconds": round(e["seconds"], 4)})
        for a in attempts:
            if a.get("restored") is not None or a.get("rto_seconds") is not None:
                rep.recoveries.append(_recovery_row(a))


def _recovery_row(attempt: dict[str, Any]) -> dict[str, Any]:
    """An attempt record's recovery figures, as the report lists them."""
    keys = ("restored", "lost_steps", "rto_seconds", "time_to_first_step_seconds", "status")
    return {"attempt": attempt["attempt"], **{k: attempt.get(k) for k in keys}}


def _differs(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return any(a[k] != b[k] for k in ("loss", "grad_norm", "lr"))


def write_outputs(work: Path, report: DrillReport) -> None:
    data = {**asdict(report), "passed": report.passed}
    (work / "drill-report.json").write_text(json.dumps(data, indent=2))
    lines = [
        "# Recovery drill report",
        "",
        "A 2-rank CPU training job under ft_launcher, compared with the same job run without faults: a rank",
        f"killed at step {KILL_AT} and a second fault while the restore loads (recovery from step {SAVE_EVERY * 2},",
        "loss, grad norm and LR equal to the uninterrupted run's), a restart, damaged copies of the newest step",
        "rejected, and repeated failures stopping the job.",
        "",
        f"Result: **{'PASS' if report.passed else 'FAIL'}** ({report.wall_seconds:.0f} s wall)",
        "",
        "| check | result | detail |",
        "|---|---|---|",
        *[f"| {c.name} | {'pass' if c.passed else 'FAIL'} | {c.detail.replace('|', '/')} |" for c in report.checks],
        "",
        "## Recoveries",
        "",
        "| attempt | status | restored | lost steps | RTO s | start to first step s |",
        "|---|---|---|---|---|---|",
    ]
    for r in report.recoveries:
        restored = f"{r['restored']['tier']}@{r['restored']['step']}" if r.get("restored") else "-"
        lines.append(
            f"| {r['attempt']} | {r['status']} | {restored} | {r['lost_steps']} | {r['rto_seconds']} | "
            f"{r['time_to_first_step_seconds']} |"
        )
    lines += ["", "## Save and load times (s)", ""]
    for tier, secs in report.save_seconds.items():
        lines.append(f"- save, {tier}: median {sorted(secs)[len(secs) // 2]:.3f} over {len(secs)} saves")
    for row in report.load_seconds:
        lines.append(f"- load step {row['step']} from {row['tier']}: {row['seconds']:.3f}")
    (work / "drill-report.md").write_text("\n".join(lines) + "\n")


def plot_losses(work: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def rows(run_id: str) -> list[dict[str, Any]]:
        path = work / "runs" / run_id / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]

    fig, ax = plt.subplots(figsize=(9, 4.5))
    base = rows("baseline")
    ax.plot([m["step"] for m in base], [m["loss"] for m in base], color="black", lw=2.5, alpha=0.35, label="baseline")
    by_attempt: dict[str, list[dict[str, Any]]] = {}
    for m in rows("drill"):
        by_attempt.setdefault(m["attempt"], []).append(m)
    for i, (attempt, ms) in enumerate(by_attempt.items()):
        ax.plot([m["step"] for m in ms], [m["loss"] for m in ms], lw=1, label=f"drill attempt {i + 1} ({attempt[-8:]})")
    ax.axvline(KILL_AT, color="red", ls="--", lw=1, label=f"rank 1 killed (step {KILL_AT})")
    for s in range(SAVE_EVERY, TOTAL + 1, SAVE_EVERY):
        ax.axvline(s, color="grey", ls=":", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Recovery drill: baseline vs recovered runs (dotted: checkpoints)")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(work / "drill-loss.png", dpi=110)
    plt.close(fig)


def run_drill(config: str | None, workdir: str) -> int:
    work = Path(workdir).resolve()
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    report = Drill(config, work).run()
    write_outputs(work, report)
    plot_losses(work)
    print(format_goodput(goodput_from_records(work / "runs" / "drill"), "[drill] goodput (from the run's records)"))
    print(f"[drill] {'PASS' if report.passed else 'FAIL'} in {report.wall_seconds:.0f} s: {work / 'drill-report.md'}")
    return 0 if report.passed else 1

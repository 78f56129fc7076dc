"""The Prometheus exporter, scraped over HTTP from a running 2-rank job, and linted by promtool."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pretrain.commands.ft_command import ft_launcher_command
from tests.helpers import FT_CPU, TINY, free_port, job_env, overrides_for, read_jsonl

pytestmark = pytest.mark.slow


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "run_id")))] = s.value
    return out


def test_metrics_are_served_while_training(tmp_path: Path, corpus: Path) -> None:
    port = free_port()
    over = overrides_for(
        tmp_path,
        corpus,
        **{
            "train.steps": 3000,
            "checkpoint.local.interval": 10,
            "checkpoint.reshardable.interval": 40,
            "metrics.port": port,
            "metrics.host": "127.0.0.1",
        },
    )
    cmd = ft_launcher_command(TINY, nproc=2, ft_config=FT_CPU, max_restarts=1, overrides=over)
    with open(tmp_path / "job.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=job_env(tmp_path), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        samples: dict = {}
        text = ""
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "job.log").read_text()[-3000:]
            try:
                text = _scrape(port)
                samples = _samples(text)
            except OSError:
                time.sleep(0.2)
                continue
            if (
                samples.get(("training_steps_total", ()))
                and samples.get(("checkpoint_save_duration_seconds_count", (("tier", "reshardable"),)), 0) >= 1
            ):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"metrics never showed a reshardable save:\n{text[-2000:]}")
        metrics = read_jsonl(tmp_path / "runs" / "t" / "metrics.jsonl")
        steps = samples[("training_steps_total", ())]
        assert 40 <= steps <= metrics[-1]["step"] + 1
        assert samples[("training_step", ())] >= 40
        assert samples[("training_tokens_total", ())] == steps * 8 * 128
        now = time.time()
        for tier in ("local", "reshardable"):
            ts = samples[("checkpoint_last_success_timestamp_seconds", (("tier", tier),))]
            assert now - 60 < ts <= now
            assert samples[("checkpoint_save_duration_seconds_count", (("tier", tier),))] >= 1
        planned_local = samples[("checkpoint_planned_interval_seconds", (("tier", "local"),))]
        planned_resh = samples[("checkpoint_planned_interval_seconds", (("tier", "reshardable"),))]
        assert 0 < planned_local < planned_resh and abs(planned_resh / planned_local - 4) < 1e-6
        # Background saves: one save per tier (tier 1, reshardable staging) may be in flight at the
        # scrape (checkpoint.async.max_in_flight=1); whatever is in flight is not yet committed.
        depth = samples[("checkpoint_async_queue_depth", ())]
        assert depth in (0, 1, 2) and depth == samples[("checkpoint_uncommitted_versions", ())]
        assert samples[("training_lost_steps_total", ())] == 0
        if shutil.which("promtool"):
            lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
            assert lint.returncode == 0, lint.stdout + lint.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)

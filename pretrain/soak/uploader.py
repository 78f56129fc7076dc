"""The uploader beside a soak run, and what it tells Prometheus.

Owns one ``pretrain upload --config CFG --watch --metrics-port P`` process (as ``pretrain demo``
runs it: its own process, training never waits for it) and reading its metrics page: the
records a user alerts on (monitoring/alerts.yaml's ``CheckpointPromotionFailing`` reads
``uploader_failures_total``; ``CheckpointStale`` the promotion time). It never decides when the
store is cut (``pretrain.soak.runner``) nor judges what it read (``pretrain.soak.report``). The
owner calls :meth:`Uploader.stop` in a ``finally``.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

SCRAPE_TIMEOUT_S = 2.0
POLL_S = 0.1
STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class UploaderState:
    """One scrape of the uploader's metrics page."""

    time: float  # when it was read
    store_failures: float  # uploader_failures_total{reason="store"}: failed promotion rounds
    promoted_step: int | None  # uploader_last_promoted_step (None: nothing promoted yet)
    promoted_at: float | None  # uploader_last_promoted_timestamp_seconds: when that step was committed


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def parse_metrics(text: str, now: float) -> UploaderState:
    """The uploader's series from a Prometheus text page."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "uploader_failures_total" and sample.labels.get("reason") == "store":
                values["failures"] = sample.value
            elif sample.name in ("uploader_last_promoted_step", "uploader_last_promoted_timestamp_seconds"):
                values[sample.name] = sample.value
    step = values.get("uploader_last_promoted_step")
    return UploaderState(
        now,
        values.get("failures", 0.0),
        int(step) if step is not None else None,
        values.get("uploader_last_promoted_timestamp_seconds"),
    )


class Uploader:
    """``pretrain upload --watch`` with ``cfg_path``'s store, run and staging, its log in ``log``."""

    def __init__(self, cfg_path: Path, log: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "pretrain", "upload", "--config", str(cfg_path), "--watch"]
        cmd += ["--metrics-port", str(self.port)]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def read(self) -> UploaderState | None:
        """Scrape the metrics page now; None while it does not answer (starting, or gone)."""
        url = f"http://127.0.0.1:{self.port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as resp:  # noqa: S310 (our own port)
                text = resp.read().decode()
        except (urllib.error.URLError, OSError):
            return None
        return parse_metrics(text, time.time())

    def wait_read(self, timeout: float) -> UploaderState | None:
        """The first scrape that answers within ``timeout`` (None: it never did, or the uploader exited)."""
        return self.wait_for(lambda _: True, timeout)

    def wait_for(self, accept: Callable[[UploaderState], bool], timeout: float) -> UploaderState | None:
        """The first scrape ``accept`` takes within ``timeout``; None if none did or the uploader exited."""
        deadline = time.time() + timeout
        while time.time() < deadline and self.proc.poll() is None:
            state = self.read()
            if state is not None and accept(state):
                return state
            time.sleep(POLL_S)
        return None

    def stop(self) -> int | None:
        """SIGTERM (the uploader finishes its round and exits), SIGKILL after ``STOP_TIMEOUT_S``; its exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(10)
        return self.proc.returncode

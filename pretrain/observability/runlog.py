"""Append-only run records: ``metrics.jsonl`` (one line per step) and ``events.jsonl``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def run_dir(run_root: str, run_id: str) -> Path:
    return Path(run_root) / run_id


def append_jsonl(path: Path, record: dict[str, Any], durable: bool = False) -> None:
    """Append one JSON line with a single write (O_APPEND keeps concurrent lines whole)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line from a killed writer
    return out


class RunLog:
    def __init__(self, run_root: str, run_id: str, attempt: str, enabled: bool) -> None:
        self.dir = run_dir(run_root, run_id)
        self.attempt = attempt
        self.enabled = enabled

    @property
    def metrics_path(self) -> Path:
        return self.dir / "metrics.jsonl"

    @property
    def events_path(self) -> Path:
        return self.dir / "events.jsonl"

    def metrics(self, **record: Any) -> None:
        if self.enabled:
            append_jsonl(self.metrics_path, {**record, "attempt": self.attempt, "time": time.time()})

    def event(self, event: str, force: bool = False, durable: bool = True, **record: Any) -> None:
        """Rank 0 records events; ``force`` lets another rank record its own (e.g. an injected fault).
        ``durable=False`` skips the fsync, for events on the training step's path whose outcome
        is recorded durably later (a save's start: its "save" or "save_failed" event follows)."""
        if self.enabled or force:
            append_jsonl(
                self.events_path,
                {"event": event, **record, "attempt": self.attempt, "time": time.time()},
                durable=durable,
            )

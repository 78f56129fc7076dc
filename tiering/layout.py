"""Names and places: ``<root>/<run_id>/steps/step-000000123/`` and friends."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

STEP_WIDTH = 9
_STEP_RE = re.compile(rf"^step-(\d{{{STEP_WIDTH}}})$")
_TMP_RE = re.compile(rf"^step-(\d{{{STEP_WIDTH}}})\.tmp-(.+)$")


def step_name(step: int) -> str:
    return f"step-{step:0{STEP_WIDTH}d}"


def parse_step_name(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def parse_tmp_name(name: str) -> tuple[int, str] | None:
    m = _TMP_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


@dataclass(frozen=True)
class RunLayout:
    """Directory layout of one run inside one tier root."""

    root: Path
    run_id: str

    @property
    def run_dir(self) -> Path:
        return self.root / self.run_id

    @property
    def steps_dir(self) -> Path:
        return self.run_dir / "steps"

    @property
    def quarantine_dir(self) -> Path:
        return self.run_dir / "quarantine"

    @property
    def latest_path(self) -> Path:
        return self.run_dir / "latest.json"

    def step_dir(self, step: int) -> Path:
        return self.steps_dir / step_name(step)

    def tmp_dir(self, step: int, attempt: str) -> Path:
        return self.steps_dir / f"{step_name(step)}.tmp-{attempt}"

    @classmethod
    def from_step_dir(cls, step_dir: Path) -> RunLayout:
        """Inverse of :meth:`step_dir` (``.../<run_id>/steps/step-N``)."""
        step_dir = Path(step_dir)
        return cls(step_dir.parent.parent.parent, step_dir.parent.parent.name)

"""The run's excluded-nodes file: nodes a run must not train on again (persistent stragglers).

Owns ``<run dir>/excluded-nodes.jsonl``: one JSON object per line, one line per node, with the
evidence (``reason``, ``step``, ``attempt``, and the ``reports`` that judged it: step and every
rank's relative score). Rank 0 adds a node (:func:`exclude`, the whole file replaced in one
rename, so a reader sees the old list or the new one); ``pretrain launch`` refuses to start on a
listed node (:func:`refusal`) and prints the list for the sbatch requeue (``--excluded-nodes``).
A person removes a node's line once the node is repaired. Never decides who is slow (that is
:mod:`pretrain.resilience.stragglers`) and never talks to a scheduler.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tiering.system.fsio import atomic_write_bytes

FILE = "excluded-nodes.jsonl"


def path_of(run_dir: Path) -> Path:
    return run_dir / FILE


def read_excluded(run_dir: Path) -> dict[str, dict[str, Any]]:
    """node -> its record; a line that is not JSON is kept as a record with ``unreadable`` (the
    node named by its first word), so a hand edit cannot silently let a node back in."""
    try:
        text = path_of(run_dir).read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            record = json.loads(line)
            out[str(record["node"])] = record
        except (ValueError, KeyError, TypeError):
            out[line.split()[0]] = {"node": line.split()[0], "unreadable": line.strip()}
    return out


def exclude(run_dir: Path, node: str, **evidence: Any) -> Path:
    """Add (or replace) ``node``'s line; returns the file."""
    records = read_excluded(run_dir)
    records[node] = {"node": node, **evidence}
    body = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records.values())
    path = path_of(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, body.encode())
    return path


def refusal(run_dir: Path, node: str) -> str | None:
    """The one line ``pretrain launch`` refuses with when ``node`` is listed (None: it is not)."""
    record = read_excluded(run_dir).get(node)
    if record is None:
        return None
    why = record.get("reason") or record.get("unreadable") or "listed"
    path = path_of(run_dir)
    return (
        f"node {node} is excluded from run {run_dir.name} ({why}) by {path}; fix: start the job on other "
        f"nodes (sbatch --exclude={node}; on Kubernetes the pod is rescheduled off the tainted node), or "
        f"delete the node's line from {path} once it is repaired"
    )

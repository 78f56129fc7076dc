"""The soak's timeline plot (``soak-timeline.png``): steps against wall time for the baseline and the
faulted run, each fault, its detection and the next step marked. Reads the runs' ``metrics.jsonl``
and the report's fault rows; draws only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pretrain.soak.runner import read_metrics


def plot_timeline(
    path: Path, base_dir: Path, base_t0: float, faulted_dir: Path, t0: float, faults: list[dict[str, Any]]
) -> None:
    import matplotlib  # deferred: a heavy optional dependency, only for this picture

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5))
    base = read_metrics(base_dir)
    ax.plot([r["time"] - base_t0 for r in base], [r["step"] for r in base], color="black", lw=2, alpha=0.3,
            label="fault-free")  # fmt: skip
    by_attempt: dict[str, list[dict[str, Any]]] = {}
    for r in read_metrics(faulted_dir):
        by_attempt.setdefault(r["attempt"], []).append(r)
    for rows in by_attempt.values():
        ax.plot([r["time"] - t0 for r in rows], [r["step"] for r in rows], lw=1.2)
    top = max((r["step"] for rows in by_attempt.values() for r in rows), default=1)
    for f in faults:
        x = f["at_s"]
        ax.axvline(x, color="red", lw=0.8, ls="--")
        ax.text(x, top * 1.01, f"{f['index']}:{f['kind']}", rotation=90, fontsize=7, va="bottom", color="red")
        if f.get("detection_s") is not None:
            ax.plot([x + f["detection_s"]], [top * 0.02], marker="v", color="orange", ms=5)
        if f.get("fault_to_next_step_s") is not None:
            ax.plot([x + f["fault_to_next_step_s"]], [top * 0.05], marker="^", color="green", ms=5)
        if f.get("restored"):
            ax.plot([x + (f["fault_to_next_step_s"] or 0)], [f["restored"]["step"]], marker="o", color="blue", ms=4)
    ax.plot([], [], "v", color="orange", label="detected (old ranks gone)")
    ax.plot([], [], "^", color="green", label="next step")
    ax.plot([], [], "o", color="blue", label="restored step")
    ax.set_xlabel("seconds since launch")
    ax.set_ylabel("step")
    ax.set_title("Soak: steps over time, one line per attempt (dashed red: faults)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""The planner's goodput for the soak's own measured costs, beside the goodput the records measured.

``pretrain plan`` projects goodput with the first-order model ``1 - save/interval - (restart +
interval/2) / MTBF`` (:func:`pretrain.commands.plan.goodput`). Here every input is what the soak
measured, so the two figures differ only by what the model leaves out:

* MTBF: the faulted run's wall time over the faults that restarted the job (a storage or store
  fault does not: the job trains on);
* restart: their mean fault -> next step;
* interval: the steps between saves of the nearest tier that survives a process fault (tier 0
  when enabled, else tier 1) times the fault-free baseline's mean productive step;
* save: the baseline's checkpoint badput (blocked time and step excess) as a share of its wall
  time, times that interval.

The model's lost work is half an interval per fault; the measured mean is reported beside it.
What the model has no term for (the wait for a relaunch after a preemption, the storage faults'
own cost) shows in the report's badput by cause. Reads the report only.
"""

from __future__ import annotations

from typing import Any

from pretrain.commands.plan import goodput
from pretrain.soak.schedule import KINDS


def planner_projection(report: dict[str, Any], interval_steps: int) -> dict[str, Any]:
    """The projection and its inputs (all None where the soak had no restarting fault or no baseline)."""
    faulted, base = report["goodput"]["faulted"], report["goodput"]["baseline"]
    restarted = [f for f in report["faults"] if KINDS[f["kind"]].restarts and f.get("fault_to_next_step_s") is not None]
    if not restarted or not base.get("steps_run") or not base.get("wall_s") or not faulted.get("wall_s"):
        return {"projected": None, "measured": faulted.get("goodput_ratio"), "inputs": None}
    step_s = base["productive_s"] / base["steps_run"]
    interval_s = interval_steps * step_s
    save_s = base["badput_s"]["checkpoint"] / base["wall_s"] * interval_s
    restart_s = sum(f["fault_to_next_step_s"] for f in restarted) / len(restarted)
    mtbf_s = faulted["wall_s"] / len(restarted)
    lost = [f["lost_steps"] for f in restarted if f.get("lost_steps") is not None]
    inputs = {
        "mtbf_s": round(mtbf_s, 2),
        "restarts": len(restarted),
        "restart_s": round(restart_s, 3),
        "interval_steps": interval_steps,
        "interval_s": round(interval_s, 3),
        "save_s": round(save_s, 4),
        "lost_work_model_s": round(interval_s / 2, 3),
        "lost_work_measured_s": round(sum(lost) / len(lost) * step_s, 3) if lost else None,
    }
    return {
        "projected": round(goodput(interval_s, save_s, restart_s, mtbf_s), 4),
        "measured": faulted["goodput_ratio"],
        "inputs": inputs,
    }


def projection_line(projection: dict[str, Any]) -> str:
    """One line of the headline: the planner's figure against the measured one, with its inputs."""
    i = projection["inputs"]
    if projection["projected"] is None or i is None:
        return "planner's projection : - (no fault restarted the job)"
    measured = projection["measured"]
    lost = f"{i['lost_work_measured_s']:.2f} s measured" if i["lost_work_measured_s"] is not None else "not measured"
    return (
        f"planner's projection : {projection['projected']:.1%} for the measured costs against "
        f"{measured:.1%} from the records (MTBF {i['mtbf_s']:.1f} s over {i['restarts']} restarts, restart "
        f"{i['restart_s']:.2f} s, save {i['save_s']:.3f} s every {i['interval_steps']} steps = "
        f"{i['interval_s']:.2f} s; "
        f"lost work per fault {i['lost_work_model_s']:.2f} s in the model, {lost})"
    )

"""Background tier-1 save against a synchronous one, on a state the size of a model of up to 0.8B parameters.

``python -m tests.gpu.snapshot_bench --mode cuda|cpu --workdir DIR --out result.json [--budget-s S]``

The state is laid out as the DistributedOptimizer keeps it on one GPU: bf16 weights, fp32 master
weights and two fp32 Adam moments (14 bytes a parameter: 11.2 GB at 0.8B parameters on CUDA,
~28 MB with ``--mode cpu``). The bench writes the state five times with fsync (one file at a
time), so the size is planned first (:func:`plan_params`): at most half the work directory's free
disk, at most 70 % of the GPU's free memory, and five writes within half the time budget at the
write speed measured on that disk by a probe (the same durable write and digest); the report
names the limit that applied. The save is the project's own (:class:`BackgroundWrite` in ``thread``
mode with reused :class:`SnapshotBuffers`: pinned host buffers filled on a side CUDA stream, then
serialisation + chunked digest + fsync by the writer thread). A training step is simulated by bf16 GEMMs
(the forward/backward, which only read the state) followed by an in-place update of every state
tensor (the optimizer step, before which the trainer waits for the snapshot). Measured in one run:

* blocked time of a background save (start + the wait before the in-place update) against a
  synchronous save of the same state (copy to host, the same serialisation and digest, fsync);
* snapshot bandwidth (a save's copy into the reused pinned buffers, waited for at once) against a
  raw ``copy_`` of the same tensors into pinned memory on a side stream;
* steps/s over the same number of steps with one background save started at the second step
  (its write overlapping them) and without saves.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pretrain.checkpointing.async_writer import BackgroundWrite, SnapshotBuffers, save_state
from tiering.system.fsio import write_file_durably

SIZES = {  # parameters, GEMM side, GEMMs per step, steps per timing window
    "cuda": {"params": 800_000_000, "gemm": 8192, "gemms": 60, "steps": 20},
    "cpu": {"params": 2_000_000, "gemm": 256, "gemms": 4, "steps": 4},
}
CHUNKS = 32  # tensors per kind, like a model's layers
BYTES_PER_PARAM = 14  # bf16 weight, fp32 master weight, two fp32 Adam moments
WRITES = 5  # two background snapshots, one save during training, two synchronous saves
PROBE_BYTES = {"cuda": 1 << 30, "cpu": 16 << 20}


def plan_params(
    max_params: int, free_disk: int, free_gpu: int | None, write_bytes_per_s: float, budget_s: float
) -> tuple[int, str]:
    """How many parameters the bench's state gets, and what limited it: ``model`` (the full
    size), ``disk`` (half the free disk: one file at a time, and room for the run's others),
    ``gpu_memory`` (70 % of the free GPU memory) or ``time`` (the five writes within half the
    budget at the measured speed). Rounded down to whole chunks."""
    limits = {
        "model": max_params,
        "disk": free_disk // 2 // BYTES_PER_PARAM,
        "time": int(budget_s / 2 * write_bytes_per_s / WRITES / BYTES_PER_PARAM),
    }
    if free_gpu is not None:
        limits["gpu_memory"] = int(free_gpu * 0.7) // BYTES_PER_PARAM
    limited_by = min(limits, key=lambda k: limits[k])
    return max(limits[limited_by] // CHUNKS * CHUNKS, CHUNKS), limited_by


def probe_write_speed(workdir: Path, nbytes: int) -> float:
    """Bytes per second of one durable write (serialisation, digest, fsync) of ``nbytes``."""
    payload = {"probe": torch.zeros(nbytes // 4, dtype=torch.float32)}
    path = workdir / "probe.pt"
    t0 = time.perf_counter()
    write_file_durably(path, lambda fh: save_state(payload, fh))
    seconds = time.perf_counter() - t0
    path.unlink(missing_ok=True)
    return nbytes / seconds


class State:
    """bf16 weights, fp32 master weights and Adam moments on the device, and a simulated step."""

    def __init__(self, mode: str, params: int) -> None:
        size = SIZES[mode]
        self.device = torch.device("cuda", 0) if mode == "cuda" else torch.device("cpu")
        n = params // CHUNKS
        kinds = {
            "weight": torch.bfloat16,
            "master": torch.float32,
            "exp_avg": torch.float32,
            "exp_avg_sq": torch.float32,
        }
        self.tensors = {
            f"{kind}.{i}": torch.randn(n, device=self.device).to(dtype)
            for kind, dtype in kinds.items()
            for i in range(CHUNKS)
        }
        dtype = torch.bfloat16 if mode == "cuda" else torch.float32
        self.a = torch.randn(size["gemm"], size["gemm"], device=self.device, dtype=dtype)
        self.gemms = size["gemms"]
        self.steps = size["steps"]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def forward_backward(self) -> None:
        x, scale = self.a, self.a.shape[0] ** -0.5  # keeps the values' scale from one GEMM to the next
        for _ in range(self.gemms):
            x = torch.mm(x, self.a).mul_(scale)

    def optimizer_step(self) -> None:
        for t in self.tensors.values():
            t.mul_(0.999)


def timed(fn: Any, state: State) -> float:
    state.sync()
    t0 = time.perf_counter()
    fn()
    state.sync()
    return time.perf_counter() - t0


def raw_pinned_copy(state: State) -> dict[str, float]:
    """``copy_`` of every state tensor into preallocated pinned host memory on a side stream."""
    cuda = state.device.type == "cuda"
    t0 = time.perf_counter()
    bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in state.tensors.values()]
    alloc = time.perf_counter() - t0
    stream = torch.cuda.Stream() if cuda else None

    def copy() -> None:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for buf, t in zip(bufs, state.tensors.values()):
                buf.copy_(t, non_blocking=cuda)
        if stream is not None:
            stream.synchronize()

    seconds = statistics.median(timed(copy, state) for _ in range(3))
    return {"alloc_seconds": alloc, "seconds": seconds, "gb_per_s": state.bytes / seconds / 1e9}


def background_snapshot(state: State, buffers: SnapshotBuffers, path: Path) -> dict[str, float]:
    """One background save whose snapshot is waited for at once (its copy time), then its write."""
    state.sync()
    t0 = time.perf_counter()
    save = BackgroundWrite("thread", dict(state.tensors), path, buffers=buffers)
    save.wait_for_snapshot()
    snapshot = time.perf_counter() - t0
    outcome = save.poll(block=True)
    path.unlink(missing_ok=True)
    assert outcome is not None and outcome.ok, outcome
    return {
        "snapshot_seconds": snapshot,
        "gb_per_s": state.bytes / snapshot / 1e9,
        "write_seconds": outcome.seconds,
        "copy_binding": save.copy_binding,  # on GPU: the device of the tensors, the thread and the stream
    }


def train_steps(state: State, save_path: Path | None, buffers: SnapshotBuffers) -> dict[str, Any]:
    """``steps`` simulated steps; with ``save_path``, a background save starts before the second."""
    blocked = 0.0
    save = None
    state.sync()
    t0 = time.perf_counter()
    for step in range(state.steps):
        if save_path is not None and step == 1:
            t = time.perf_counter()
            save = BackgroundWrite("thread", dict(state.tensors), save_path, buffers=buffers)
            blocked += time.perf_counter() - t
        state.forward_backward()
        if save is not None:
            t = time.perf_counter()
            save.wait_for_snapshot()
            blocked += time.perf_counter() - t
        state.optimizer_step()
    state.sync()
    elapsed = time.perf_counter() - t0
    out: dict[str, Any] = {"steps": state.steps, "seconds": elapsed, "steps_per_s": state.steps / elapsed}
    if save is not None:
        outcome = save.poll(block=True)
        assert outcome is not None and outcome.ok, outcome
        out |= {"blocked_seconds": blocked, "write_seconds": outcome.seconds}
        save_path.unlink(missing_ok=True)  # type: ignore[union-attr]
    return out


def sync_save(state: State, path: Path) -> float:
    """The synchronous baseline: copy to host, then the writer's own serialisation with its digest
    and fsync (what the background writer does later), all blocking."""
    state.sync()
    t0 = time.perf_counter()
    host = {k: t.to("cpu", copy=True) for k, t in state.tensors.items()}
    write_file_durably(path, lambda fh: save_state(host, fh))
    seconds = time.perf_counter() - t0
    path.unlink(missing_ok=True)
    return seconds


def run(mode: str, workdir: Path, budget_s: float) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    speed = probe_write_speed(workdir, PROBE_BYTES[mode])
    free_gpu = torch.cuda.mem_get_info(0)[0] if mode == "cuda" else None
    free_disk = shutil.disk_usage(workdir).free
    params, limited_by = plan_params(SIZES[mode]["params"], free_disk, free_gpu, speed, budget_s)
    sizing = {
        "params": params,
        "limited_by": limited_by,
        "free_disk_gb": round(free_disk / 1e9, 1),
        "free_gpu_gb": round(free_gpu / 1e9, 1) if free_gpu is not None else None,
        "probe_write_gb_per_s": round(speed / 1e9, 3),
        "budget_s": budget_s,
    }
    state = State(mode, params)
    buffers = SnapshotBuffers()
    raw = raw_pinned_copy(state)
    cold = background_snapshot(state, buffers, workdir / "cold.pt")
    warm = background_snapshot(state, buffers, workdir / "warm.pt")
    state.forward_backward()  # GEMM libraries warmed up before either timing window
    without = train_steps(state, None, buffers)
    with_save = train_steps(state, workdir / "during.pt", buffers)
    syncs = [sync_save(state, workdir / f"sync-{i}.pt") for i in range(2)]
    sync_s = statistics.median(syncs)
    return {
        "mode": mode,
        "sizing": sizing,
        "copy_binding": warm["copy_binding"],
        "state_bytes": state.bytes,
        "state_gb": round(state.bytes / 1e9, 2),
        "raw_pinned_copy": raw,
        "snapshot_first_save": cold,
        "snapshot": warm,
        "snapshot_over_raw_bandwidth": warm["gb_per_s"] / raw["gb_per_s"],
        "background_blocked_seconds": with_save["blocked_seconds"],
        "sync_save_seconds": syncs,
        "blocked_ratio": with_save["blocked_seconds"] / sync_s,
        "steps_per_s_with_save": with_save["steps_per_s"],
        "steps_per_s_without_save": without["steps_per_s"],
        "steps_per_s_ratio": with_save["steps_per_s"] / without["steps_per_s"],
        "train_with_save": with_save,
        "train_without_save": without,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--mode", choices=["cuda", "cpu"], required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget-s", type=float, default=120.0, help="the time the whole bench may take")
    args = parser.parse_args(argv)
    result = run(args.mode, Path(args.workdir), args.budget_s)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("state_gb", "blocked_ratio", "snapshot_over_raw_bandwidth")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

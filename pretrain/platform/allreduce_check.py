"""The bus bandwidth of an all-reduce across the job's ranks: is the fast network in use?

Run under ``torchrun`` (or ``ft_launcher``) on the nodes of a job before its first run on a new
image or node group: ``python -m pretrain.platform.allreduce_check [--mib N] [--min-busbw-gbs X]``.
Every rank all-reduces a buffer of ``--mib`` MiB (bf16 on CUDA with NCCL, fp32 on CPU with gloo)
a few times to warm up, then ``--iters`` times timed; rank 0 prints one JSON line (world size,
backend, seconds per all-reduce, the algorithm and bus bandwidths nccl-tests reports:
``busbw = algbw x 2 (n - 1) / n``) and, with ``--min-busbw-gbs``, exits 1 with one line naming the
figure and the fix when the bus bandwidth is lower (on EFA nodes: hundreds of GB/s between two
p5.48xlarge; TCP sockets give a few). ``scripts/gpu-check.sh --multi-node`` runs it; its CPU dry
run (gloo, two local ranks) is in ``make test``.

Never: changes the job's state or files; it only measures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from pretrain.platform.rank_device import select_rank_device


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algorithm, bus) bandwidth in GB/s of one all-reduce of ``nbytes`` over ``world`` ranks."""
    alg = nbytes / seconds / 1e9
    return alg, alg * 2 * (world - 1) / world


def measure(mib: int, iters: int, warmup: int = 3) -> dict[str, float | int | str]:
    """All-reduce a ``mib`` MiB buffer on this process's group; the figures rank 0 reports."""
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    x = torch.ones(mib * 2**20 // (torch.finfo(dtype).bits // 8), dtype=dtype, device=device)
    for _ in range(warmup):
        dist.all_reduce(x)
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    if cuda:
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - t0) / iters
    nbytes = x.numel() * x.element_size()
    alg, bus = bus_bandwidth(nbytes, seconds, dist.get_world_size())
    return {
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "bytes": nbytes,
        "seconds": round(seconds, 6),
        "algbw_gbs": round(alg, 3),
        "busbw_gbs": round(bus, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.platform.allreduce_check")
    parser.add_argument("--mib", type=int, default=512, help="all-reduced buffer per rank (MiB)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--min-busbw-gbs", type=float, default=None, help="exit 1 below this bus bandwidth")
    args = parser.parse_args(argv)
    device = select_rank_device()  # before NCCL, as every process group of the rank program
    dist.init_process_group("nccl" if device is not None else "gloo", timeout=datetime.timedelta(minutes=5))
    try:
        figures = measure(args.mib, args.iters)
    finally:
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    print(json.dumps(figures), flush=True)
    low = args.min_busbw_gbs
    if low is not None and figures["busbw_gbs"] < low:  # type: ignore[operator]
        print(
            f"allreduce check: bus bandwidth {figures['busbw_gbs']} GB/s over {figures['world_size']} ranks "
            f"({figures['backend']}) is below {low} GB/s; fix: check that NCCL uses the fast network "
            "(NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET: 'NET/OFI Selected Provider is efa', not NET/Socket)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

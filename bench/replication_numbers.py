"""Tiers 1-2 on this machine: per-rank local save and peer replication of a ~300 MB per-rank state,
each as a ratio to a durable sequential write of the same bytes measured in the same run, and
restore seconds from the own copy and from a peer replica.

Run: ``python -m bench.replication_numbers [--mb 300] [--repeats 3]`` (2 ranks, gloo, loopback).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tiering.collective import SingleProcess, TorchCollective
from tiering.local.posix import primary_store
from tiering.local.publish import PosixStepPublisher, manifest_for
from tiering.peer.placement import RankIdentity, replica_holders
from tiering.peer.replication import PeerReplicator
from tiering.peer.restore import PeerRecovery
from tiering.peer.transport import Transport
from tiering.trust.run_key import RunKey

TOPOLOGY = {"tp": 1, "pp": 1, "dp": 2, "world_size": 2}

BENCH_KEY = RunKey(b"bench-run-key-" * 3)  # the same on every rank: benches measure, they guard nothing


def raw_durable_write(path: Path, nbytes: int) -> float:
    """Baseline: write the same number of bytes sequentially and fsync."""
    block = os.urandom(8 * 1024 * 1024)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as fh:
        left = nbytes
        while left > 0:
            left -= fh.write(block[: min(len(block), left)])
        os.fsync(fh.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return dt


def worker(rank: int, world: int, root: str, mb: int, repeats: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=600))
    coll = TorchCollective()
    node_root = Path(root) / f"node-{rank}" / "run"  # one "node" per rank: separate local roots
    holders = replica_holders([RankIdentity(r, f"node-{r}", f"rack-{r}") for r in range(world)], 2, False)
    transport = Transport(group, 600, key=BENCH_KEY)
    state = {"weights": torch.randn(mb * 1024 * 1024 // 4)}
    rows = []
    for i in range(repeats):
        step = 10 * (i + 1)
        store = primary_store(node_root, rank, "run", keep=1)
        pub = PosixStepPublisher(store.layout, SingleProcess(), f"a{i}")
        coll.barrier()
        t0 = time.perf_counter()
        tmp = pub.begin(step)
        torch.save(state, tmp / "state.pt")
        manifest = pub.commit(
            tmp, manifest_for("run", step, world, {"tp": 1, "pp": 1, "dp": 2}, extra={"owner_rank": rank})
        )
        local_s = time.perf_counter() - t0
        replicator = PeerReplicator("run", rank, holders, node_root, transport, TorchCollective(group), 1, f"a{i}")
        coll.barrier()
        t1 = time.perf_counter()
        report = replicator.replicate(step, store.step_path(step))
        repl_s = time.perf_counter() - t1
        assert not report.under_replicated, report
        raw_s = raw_durable_write(Path(root) / f"raw-{rank}.bin", manifest.total_bytes)
        # Restore from own copy: verify (SHA-256) + load.
        coll.barrier()
        t2 = time.perf_counter()
        rec = PeerRecovery("run", rank, world, f"node-{rank}", node_root, coll, transport, TOPOLOGY, 1, f"r{i}")
        own = rec.recover().restore
        torch.load(own.path / "state.pt", weights_only=True)
        own_s = time.perf_counter() - t2
        # Restore from a peer: rank 1's node is replaced (local root wiped).
        coll.barrier()
        if rank == 1:
            shutil.rmtree(node_root)
        coll.barrier()
        t3 = time.perf_counter()
        rec = PeerRecovery("run", rank, world, f"node-{rank}", node_root, coll, transport, TOPOLOGY, 1, f"p{i}")
        got = rec.recover().restore
        torch.load(got.path / "state.pt", weights_only=True)
        peer_s = time.perf_counter() - t3
        rows.append(
            {
                "bytes": manifest.total_bytes,
                "local_write_s": local_s,
                "replication_s": repl_s,
                "raw_durable_write_s": raw_s,
                "restore_own_s": own_s,
                "restore_peer_s": peer_s,
                "peer_tier": got.tier,
            }
        )
    gathered = coll.all_gather(rows)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as td:
        out = Path(td) / "rows.json"
        port = 29000 + os.getpid() % 1000
        mp.spawn(worker, args=(2, td, args.mb, args.repeats, port, str(out)), nprocs=2, join=True)
        per_rank = json.loads(out.read_text())
    rows = [r for rank_rows in per_rank for r in rank_rows[1:]] or [r for rank_rows in per_rank for r in rank_rows]
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k not in ("peer_tier",)}
    mb = med["bytes"] / 1e6
    print(f"per-rank state: {mb:.0f} MB, 2 ranks on separate local roots, medians of {len(rows)} (first run dropped)")
    print(
        f"local write (publish incl. SHA-256, fsync, rename): {med['local_write_s']:.3f} s = "
        f"{med['local_write_s'] / med['raw_durable_write_s']:.2f}x raw durable write "
        f"({med['raw_durable_write_s']:.3f} s)"
    )
    print(
        f"replication to the peer (send, verify, fsync, commit): {med['replication_s']:.3f} s = "
        f"{med['replication_s'] / med['raw_durable_write_s']:.2f}x raw durable write"
    )
    print(
        f"restore from own copy (verify + load): {med['restore_own_s']:.3f} s; "
        f"from a peer replica (verify, send, publish, load): {med['restore_peer_s']:.3f} s"
    )
    print(json.dumps(med))
    return 0


if __name__ == "__main__":
    sys.exit(main())

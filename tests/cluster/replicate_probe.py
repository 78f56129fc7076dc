"""One rank of a 2-rank tier-2 replication probe across two cluster nodes (tests/test_cluster_netem.py).

Contract: ``python -m tests.cluster.replicate_probe RANK MASTER PORT NODE_ROOT CONTROL BYTES TIMEOUT_S``
joins a gloo group of two (TCP store on ``MASTER:PORT``), then for round k = 1, 2, ... waits for
``CONTROL/go-k`` (the test sets the link's netem first), publishes a real tier-1 step ``k`` of
``BYTES`` random bytes under ``NODE_ROOT``, replicates it to the other rank with the production
:class:`tiering.peer.replication.PeerReplicator` (transport bound ``TIMEOUT_S``) and writes
``CONTROL/round-k.rank-RANK.json`` with the seconds it took and the under-replicated owners.
``CONTROL/stop`` ends it.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from tiering.collective import SingleProcess, TorchCollective
from tiering.local.posix import primary_store
from tiering.local.publish import PosixStepPublisher, manifest_for
from tiering.peer.replication import PeerReplicator
from tiering.peer.transport import Transport
from tiering.trust.run_key import RunKey

RUN = "probe"

PROBE_KEY = RunKey(b"replicate-probe-key-of-both-ranks")  # the same on both nodes


def publish(node_root: Path, rank: int, step: int, size: int) -> Path:
    store = primary_store(node_root, rank, RUN, keep=2)
    pub = PosixStepPublisher(store.layout, SingleProcess(), f"probe-{step}")
    tmp = pub.begin(step)
    (tmp / "state.pt").write_bytes(os.urandom(size))
    pub.commit(tmp, manifest_for(RUN, step, 2, {"tp": 1}, extra={"owner_rank": rank}))
    return store.layout.step_dir(step)


def main(argv: list[str]) -> int:
    rank, master, port, node_root, control = int(argv[0]), argv[1], int(argv[2]), Path(argv[3]), Path(argv[4])
    size, timeout_s = int(argv[5]), float(argv[6])
    dist.init_process_group(
        "gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    group = dist.new_group([0, 1], backend="gloo", timeout=datetime.timedelta(seconds=120))
    holders = {0: [1], 1: [0]}
    replicator = PeerReplicator(
        RUN, rank, holders, node_root, Transport(group, timeout_s, key=PROBE_KEY), TorchCollective(group), 2, "probe"
    )
    (control / f"ready.rank-{rank}").write_text("1")
    step = 0
    while True:
        step += 1
        while not (control / f"go-{step}").exists():
            if (control / "stop").exists():
                return 0
            time.sleep(0.02)
        published = publish(node_root, rank, step, size)
        t0 = time.perf_counter()
        report = replicator.replicate(step, published)
        seconds = time.perf_counter() - t0
        result = {"step": step, "seconds": seconds, "under_replicated": report.under_replicated}
        result["failures"] = {str(k): v for k, v in report.failures.items()}
        # Renamed into place: the test reads a round's file as soon as it exists.
        done = control / f"round-{step}.rank-{rank}.json"
        done.with_suffix(".tmp").write_text(json.dumps(result))
        os.replace(done.with_suffix(".tmp"), done)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

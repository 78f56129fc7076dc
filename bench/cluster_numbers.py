"""Training blocked per tier-1 save on impaired links: ``python -m bench.cluster_numbers`` (root).

Two nodes of the namespace cluster (``tests/cluster``), one rank each, train the tiny CPU model for
60 steps with a tier-1 save (and its replication to the other node) every 5 steps, once on clean
links and once per impairment of both nodes' egress (rate by ``tc tbf``, delay and loss by the
userspace cable). Prints, per setting, the median and largest seconds the training thread was
blocked per save (the issue's bound: within 2x of the clean run), the median replication time and
the number of under-replicated saves. Not part of ``make test`` (three jobs, minutes on 2 cores).
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from pretrain.data.prepare import build_indexed_dataset, synthetic_documents
from tests.cluster.job import start_node, wait_exit
from tests.cluster.netns import Cluster

SETTINGS: dict[str, dict[str, Any]] = {
    "clean": {},
    "delay 2ms, loss 1%, 200 Mbit/s": {"delay_ms": 2, "loss": 0.01, "rate": "200mbit"},
    "delay 5ms, loss 2%, 100 Mbit/s": {"delay_ms": 5, "loss": 0.02, "rate": "100mbit"},
}


def one_run(work: Path, corpus: Path, impairment: dict[str, Any]) -> dict[str, Any]:
    over = [
        f"run.dir={work / 'runs'}",
        f"data.prefix={corpus}",
        f"checkpoint.reshardable.dir={work / 'reshard'}",
        "train.steps=60",
        "checkpoint.local.interval=5",
        "checkpoint.reshardable.interval=1000",
        "checkpoint.replication.allow_same_domain=false",
        "checkpoint.replication.timeout_s=20",
    ]
    with Cluster(work, 2, link="cable") as cluster:
        for index in (0, 1):
            cluster.shape(index, **impairment)
        codes = wait_exit({i: start_node(cluster, i, over) for i in (0, 1)}, timeout=600)
    rows = [json.loads(x) for x in (work / "runs" / "t" / "events.jsonl").read_text().splitlines() if x.strip()]
    saves = [e for e in rows if e["event"] == "save" and e.get("tier") == "local"]
    blocked = [e["blocked_seconds"] for e in saves]
    return {
        "exit_codes": codes,
        "saves": len(saves),
        "blocked_median_s": round(statistics.median(blocked), 4),
        "blocked_max_s": round(max(blocked), 4),
        "replication_median_s": round(statistics.median(e["replication_seconds"] for e in saves), 3),
        "under_replicated_saves": sum(1 for e in saves if e["under_replicated"]),
    }


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="cluster-bench-"))
    try:
        build_indexed_dataset(synthetic_documents(1.0, seed=0), root / "corpus")
        out = {}
        for n, (name, impairment) in enumerate(SETTINGS.items()):
            out[name] = one_run(root / f"run-{n}", root / "corpus", impairment)
            print(name, out[name], flush=True)
        clean = out["clean"]["blocked_median_s"]
        for row in out.values():
            row["blocked_vs_clean"] = round(row["blocked_median_s"] / clean, 2)
        print(json.dumps(out, indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A cluster on this machine, by hand (root): ``python -m tests.cluster`` or ``scripts/cluster.sh``.

``up`` builds N nodes (network namespaces on a bridge, hostnames ``pretrain-<i>``, disks under the
work directory), starts ``pretrain launch`` on each with the tiny CPU config, and then reads fault
commands from stdin until the job ends or ``quit``; everything it made is removed on the way out,
also on Ctrl-C. ``clean`` removes what a crashed earlier cluster left.

Commands while it runs (node index ``i``)::

    down i | up i          take node i's link down (a partition: its processes live on) / heal it
    kill i                 SIGKILL every process of node i
    replace i              node i is replaced: new namespace, same name, empty disk, launcher started
    shape i [delay=MS] [loss=FRACTION] [rate=100mbit]   impair node i's egress (no args: clean)
    status                 pretrain status of the run
    quit
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from pretrain.data.prepare import build_indexed_dataset, synthetic_documents
from tests.cluster.job import start_node
from tests.cluster.netns import Cluster, remove_leftovers
from tests.helpers import PYTHON


def _overrides(work: Path, steps: int) -> list[str]:
    corpus = work / "data" / "corpus"
    if not corpus.with_suffix(".bin").exists():
        build_indexed_dataset(synthetic_documents(1.0, seed=0), corpus)
    return [
        f"run.dir={work / 'runs'}",
        f"data.prefix={corpus}",
        f"checkpoint.reshardable.dir={work / 'reshard'}",
        f"train.steps={steps}",
        "data.global_batch_size=12",
        "checkpoint.replication.allow_same_domain=false",
        "checkpoint.replication.timeout_s=10",
    ]


def _command(cluster: Cluster, line: str, over: list[str], procs: dict) -> bool:
    """Apply one stdin command; False to stop."""
    words = line.split()
    if not words:
        return True
    verb, index = words[0], int(words[1]) if len(words) > 1 and words[1].isdigit() else -1
    if verb == "quit":
        return False
    if verb in ("down", "up"):
        cluster.link(index, up=verb == "up")
    elif verb == "kill":
        cluster.kill(index)
    elif verb == "replace":
        cluster.replace(index)
        procs[index] = start_node(cluster, index, over, max_restarts=3)
    elif verb == "shape":
        opts = dict(w.split("=", 1) for w in words[2:])
        cluster.shape(index, float(opts.get("delay", 0)), float(opts.get("loss", 0)), opts.get("rate"))
    elif verb == "status":
        subprocess.run([PYTHON, "-m", "pretrain", "status", str(cluster.workdir / "runs" / "t")], check=False)
    else:
        print(f"unknown command {verb!r}; see python -m tests.cluster --help", file=sys.stderr)
    return True


def up(work: Path, nodes: int, steps: int, link: str) -> int:
    over = _overrides(work, steps)
    with Cluster(work, nodes, link=link) as cluster:
        procs = {i: start_node(cluster, i, over, max_restarts=3) for i in range(nodes)}
        print(f"cluster up: {nodes} nodes on {cluster.subnet}.0/24, logs {work}/node-*.log, run {work}/runs/t")
        for i, node in cluster.nodes.items():
            print(f"  node {i}: {node.name} {node.addr} ns={node.ns} disk={node.nvme}")
        try:
            while (line := sys.stdin.readline()) and _command(cluster, line, over, procs):
                if all(p.poll() is not None for p in procs.values()):
                    break
        except KeyboardInterrupt:
            pass
        codes = {i: p.poll() for i, p in procs.items()}
    print(f"launchers' exit codes: {codes}; everything the cluster made is removed")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="N nodes running pretrain launch; fault commands on stdin")
    u.add_argument("--workdir", type=Path, required=True)
    u.add_argument("--nodes", type=int, default=3)
    u.add_argument("--steps", type=int, default=200)
    u.add_argument("--link", choices=("veth", "cable"), default="veth", help="cable: delay/loss possible")
    sub.add_parser("clean", help="remove namespaces, links and files of crashed earlier clusters")
    args = parser.parse_args(argv)
    if args.cmd == "clean":
        print(f"removed: {remove_leftovers() or 'nothing'}")
        return 0
    return up(args.workdir.resolve(), args.nodes, args.steps, args.link)


if __name__ == "__main__":
    sys.exit(main())

"""A cluster on one machine: every node a Linux network namespace on one bridge.

Contract:

* :class:`Cluster` (a context manager) makes a hub namespace holding a bridge, a gateway veth whose
  root-namespace end has ``<subnet>.254`` (services of this machine, e.g. the S3 proxy, listen
  there), and one namespace per node with its own address ``<subnet>.<10 + index>``, its own
  hostname (a UTS namespace per process tree it runs), its own ``/etc/hosts`` naming every node
  (``ip netns exec`` binds ``/etc/netns/<ns>/hosts``), its own node-local "NVMe" directory and
  failure domain.
* Faults are real: :meth:`Cluster.link` takes the node's switch port down (a partition: its
  processes live on), :meth:`Cluster.shape` limits its rate (``tc tbf``) and delays or drops its
  frames (a node added with ``link="cable"``: this kernel has no ``netem``, see
  :mod:`tests.cluster.cable`),
  :meth:`Cluster.kill` SIGKILLs every process in its namespace by pid, :meth:`Cluster.replace` gives
  a node index a new namespace and an empty disk.
* Everything made is named ``rp16-<tag>-*`` / ``rp<tag>*`` (``tag`` from this process id) and
  removed by :meth:`Cluster.close` (also on an exception); :func:`remove_leftovers` removes what a
  crashed earlier cluster left, by that prefix, once its owner process is gone. Only addresses of
  these namespaces are used: the subnet is picked so that it collides with no route of this host.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "rp16"
NETNS_DIR = Path("/run/netns")
ETC_NETNS = Path("/etc/netns")
OWNERS = Path("/run") / f"{PREFIX}-owners"  # <tag> files holding the pid of the cluster's creator


class ClusterError(RuntimeError):
    """The harness could not set up or change the cluster; one line."""


def unavailable() -> str | None:
    """Why no cluster can be built here (None: it can): tests skip with this reason."""
    if os.geteuid() != 0:
        return "the cluster harness needs root (network namespaces)"
    for tool in ("ip", "tc", "unshare"):
        if not shutil.which(tool):
            return f"the cluster harness needs {tool} (iproute2, util-linux)"
    if not Path("/dev/net/tun").exists():
        return "the cluster harness needs /dev/net/tun (the delay/loss cable)"
    return None


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise ClusterError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ns_pids(ns: str) -> list[int]:
    out = sh("ip", "netns", "pids", ns, check=False).stdout
    return [int(x) for x in out.split() if x.isdigit()]


def kill_ns_processes(ns: str, timeout: float = 10.0) -> None:
    """SIGKILL every process in namespace ``ns`` (each by its pid) and wait until none is left."""
    deadline = time.monotonic() + timeout
    while pids := ns_pids(ns):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise ClusterError(f"processes {pids} in {ns} survive SIGKILL")
        time.sleep(0.05)


def _remove_tag(tag: str) -> None:
    namespaces = sorted(p.name for p in NETNS_DIR.glob(f"{PREFIX}-{tag}-*")) if NETNS_DIR.is_dir() else []
    for ns in namespaces:
        kill_ns_processes(ns)
    for ns in namespaces:
        sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
    links = sh("ip", "-o", "link", "show").stdout
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(f"rp{tag}"):
            sh("ip", "link", "del", name, check=False)
    for sock in Path("/tmp").glob(f"{PREFIX}-{tag}-*.sock*"):
        sock.unlink(missing_ok=True)
    (OWNERS / tag).unlink(missing_ok=True)


def remove_leftovers() -> list[str]:
    """Remove the namespaces, links and hosts files of earlier clusters whose creator has exited."""
    removed = []
    for owner in sorted(OWNERS.glob("*")) if OWNERS.is_dir() else []:
        try:
            pid = int(owner.read_text().strip() or 0)
        except (OSError, ValueError):
            pid = 0
        if pid and _pid_alive(pid) and pid != os.getpid():
            continue
        _remove_tag(owner.name)
        removed.append(owner.name)
    return removed


def _free_subnet() -> str:
    routes = sh("ip", "-4", "route", "show", "table", "all").stdout + sh("ip", "-4", "addr").stdout
    for third in [*range(100 + os.getpid() % 100, 250), *range(100, 250)]:
        net = f"10.213.{third}"
        if f"{net}." not in routes:
            return net
    raise ClusterError("no free 10.213.x.0/24 subnet; fix: remove leftover clusters (python -m tests.cluster clean)")


@dataclass
class Node:
    index: int
    name: str  # hostname, e.g. pretrain-2
    ns: str
    addr: str
    port: str  # the node's port on the bridge (a veth end in the hub namespace)
    nvme: Path
    domain: str
    procs: list[subprocess.Popen[str]] = field(default_factory=list)


class Cluster:
    """``nodes`` nodes named ``<name>-<i>``, each in failure domain ``rack-<i>``, disks under ``workdir``,
    linked by ``link`` (``veth``, or ``cable`` for delay and loss)."""

    def __init__(self, workdir: Path, nodes: int, name: str = "pretrain", link: str = "veth") -> None:
        remove_leftovers()
        self.workdir = Path(workdir)
        self.tag = f"{os.getpid() % 0xFFFF:04x}"
        self.subnet = _free_subnet()
        self.gateway = f"{self.subnet}.254"
        self.hub = f"{PREFIX}-{self.tag}-hub"
        self.basename = name
        self.nodes: dict[int, Node] = {}
        self._generation: dict[int, int] = {}
        self._cables: list[subprocess.Popen[bytes]] = []
        self.scratch: list[Path] = []  # directories made for the cluster's processes, removed on close
        self.count = nodes
        OWNERS.mkdir(parents=True, exist_ok=True)
        (OWNERS / self.tag).write_text(str(os.getpid()))
        try:
            self._make_hub()
            for i in range(nodes):
                self.add(i, link=link)
        except BaseException:
            self.close()
            raise

    # -- set-up -----------------------------------------------------------------------------------
    def _make_hub(self) -> None:
        sh("ip", "netns", "add", self.hub)
        sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        gw, gw_port = f"rp{self.tag}gw", f"rp{self.tag}gwh"
        sh("ip", "link", "add", gw, "type", "veth", "peer", "name", gw_port)
        sh("ip", "link", "set", gw_port, "netns", self.hub)
        sh("ip", "-n", self.hub, "link", "set", gw_port, "master", "br0", "up")
        sh("ip", "addr", "add", f"{self.gateway}/24", "dev", gw)
        sh("ip", "link", "set", gw, "up")

    def node_name(self, index: int) -> str:
        return f"{self.basename}-{index}"

    def address(self, index: int) -> str:
        return f"{self.subnet}.{10 + index}"

    def hosts_text(self) -> str:
        lines = ["127.0.0.1 localhost", f"{self.gateway} gateway"]
        lines += [f"{self.address(i)} {self.node_name(i)}" for i in range(self.count)]
        return "\n".join(lines) + "\n"

    def add(self, index: int, domain: str | None = None, link: str = "veth") -> Node:
        """A new namespace for node ``index`` with an empty disk (``nvme-<index>``), linked to the
        bridge by a veth pair, or (``link="cable"``) by the userspace cable that can add delay and
        loss (:mod:`tests.cluster.cable`)."""
        gen = self._generation.get(index, -1) + 1
        self._generation[index] = gen
        ns = f"{PREFIX}-{self.tag}-n{index}g{gen}"
        port, inner = f"rp{self.tag}n{index}g{gen}", f"rp{self.tag}n{index}g{gen}i"
        sh("ip", "netns", "add", ns)
        (ETC_NETNS / ns).mkdir(parents=True, exist_ok=True)
        (ETC_NETNS / ns / "hosts").write_text(self.hosts_text())
        if link == "cable":
            self._cable(index, ns, port)
        else:
            sh("ip", "link", "add", port, "type", "veth", "peer", "name", inner)
            sh("ip", "link", "set", port, "netns", self.hub)
            sh("ip", "link", "set", inner, "netns", ns)
            sh("ip", "-n", ns, "link", "set", inner, "name", "eth0")
        sh("ip", "-n", self.hub, "link", "set", port, "master", "br0", "up")
        sh("ip", "-n", ns, "addr", "add", f"{self.address(index)}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        nvme = self.workdir / f"nvme-{index}"
        shutil.rmtree(nvme, ignore_errors=True)
        nvme.mkdir(parents=True)
        node = Node(index, self.node_name(index), ns, self.address(index), port, nvme, domain or f"rack-{index}")
        self.nodes[index] = node
        return node

    def _cable(self, index: int, ns: str, port: str) -> None:
        sh("ip", "-n", ns, "tuntap", "add", "dev", "eth0", "mode", "tap")
        sh("ip", "-n", self.hub, "tuntap", "add", "dev", port, "mode", "tap")
        config = self.workdir / f"cable-{index}.json"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text('{"delay_ms": 0, "loss": 0.0}')
        sock = f"/tmp/{PREFIX}-{self.tag}-{port}.sock"
        Path(sock).unlink(missing_ok=True)
        Path(sock + ".ready").unlink(missing_ok=True)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        cmd = [sys.executable, "-m", "tests.cluster.cable"]
        log = open(self.workdir / f"cable-{index}.log", "a")  # noqa: SIM115 (kept open by the child)
        listen = ["ip", "netns", "exec", self.hub, *cmd, "listen", port, sock, str(config)]
        self._cables.append(subprocess.Popen(listen, stdout=log, stderr=log, env=env))
        deadline = time.monotonic() + 30
        while not Path(sock + ".ready").exists():
            if time.monotonic() > deadline:
                raise ClusterError(f"cable of node {index} did not start; see {log.name}")
            time.sleep(0.02)
        connect = ["ip", "netns", "exec", ns, *cmd, "connect", "eth0", sock, str(config)]
        self._cables.append(subprocess.Popen(connect, stdout=log, stderr=log, env=env))
        log.close()

    # -- processes --------------------------------------------------------------------------------
    def popen(self, index: int, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[str]:
        """Run ``argv`` on node ``index``: in its namespace, under its own hostname."""
        node = self.nodes[index]
        env = {**env, "HOSTNAME": node.name}
        wrapped = ["ip", "netns", "exec", node.ns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"']
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as out:
            proc = subprocess.Popen(
                [*wrapped, node.name, *argv], stdout=out, stderr=subprocess.STDOUT, text=True, env=env
            )
        node.procs.append(proc)
        return proc

    def run(self, index: int, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run a short command on node ``index`` and wait for it."""
        node = self.nodes[index]
        cmd = ["ip", "netns", "exec", node.ns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"']
        return subprocess.run([*cmd, node.name, *argv], capture_output=True, text=True, timeout=timeout)

    # -- faults -----------------------------------------------------------------------------------
    def link(self, index: int, up: bool) -> None:
        """Take node ``index``'s switch port down (a partition) or up again."""
        sh("ip", "-n", self.hub, "link", "set", self.nodes[index].port, "up" if up else "down")

    def shape(self, index: int, delay_ms: float = 0, loss: float = 0.0, rate: str | None = None) -> None:
        """Impair node ``index``'s egress: ``rate`` (e.g. ``100mbit``) with the kernel's ``tbf``;
        ``delay_ms`` and ``loss`` (a fraction) through its cable (``add(..., link="cable")``).
        All zero/None: a clean link again."""
        ns = self.nodes[index].ns
        sh("tc", "-n", ns, "qdisc", "del", "dev", "eth0", "root", check=False)
        if rate:
            tbf = ["tbf", "rate", rate, "burst", "64kb", "latency", "400ms"]
            sh("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", *tbf)
        config = self.workdir / f"cable-{index}.json"
        if delay_ms or loss or config.exists():
            if not config.exists():
                raise ClusterError(f"node {index} has a veth link: delay/loss need add({index}, link='cable')")
            tmp = config.with_suffix(".tmp")
            tmp.write_text(json.dumps({"delay_ms": delay_ms, "loss": loss}))
            os.replace(tmp, config)

    def kill(self, index: int) -> None:
        """SIGKILL every process of node ``index`` (by pid) and reap the ones this harness started."""
        node = self.nodes[index]
        kill_ns_processes(node.ns)
        for proc in node.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)

    def remove(self, index: int) -> None:
        """The node is gone: processes killed, namespace and port deleted, disk wiped."""
        node = self.nodes.pop(index)
        kill_ns_processes(node.ns)
        for proc in node.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        sh("ip", "netns", "del", node.ns, check=False)
        shutil.rmtree(ETC_NETNS / node.ns, ignore_errors=True)
        shutil.rmtree(node.nvme, ignore_errors=True)

    def replace(self, index: int) -> Node:
        """Node ``index`` is replaced by a new machine: same name and address, new namespace, empty disk."""
        if index in self.nodes:
            self.remove(index)
        return self.add(index)

    def close(self) -> None:
        for index in list(self.nodes):
            with contextlib.suppress(ClusterError):
                self.remove(index)
        _remove_tag(self.tag)
        for proc in self._cables:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        for path in self.scratch:
            shutil.rmtree(path, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

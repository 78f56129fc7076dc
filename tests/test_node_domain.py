"""Failure domains from node labels on Kubernetes: ``pretrain node-domain`` (the trainer pod's init
container) reads its Node, from a Node record or from an API server over HTTP with the pod's
ServiceAccount token, and writes the topology file; ``pretrain launch --dry-run``, given the
environment of the rendered manifests, takes the domain from it and passes the rendezvous store's
host (by node rank) and wait explicitly.

tests/fixtures/k8s/node-p5-us-east-1a.json is a Node in the shape ``kubectl get node -o json``
gives for an EKS p5.48xlarge (labels as listed in the EKS user guide, "Place distributed AI/ML
workloads with network topology labels"); there is no cluster here to record one from.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pretrain.commands.launch import plan_from_env, rendezvous_conf
from pretrain.errors import LaunchError
from tests.helpers import FT_CPU, PYTHON, REPO, TINY, free_port
from tests.test_k8s import build, env_configmap, env_of, trainer_pods

NODE_JSON = REPO / "tests" / "fixtures" / "k8s" / "node-p5-us-east-1a.json"
NODE = "ip-10-1-37-12.ec2.internal"
LAYER3 = "nn-2c3d4e5f607182930"
LAYER2 = "nn-1b2c3d4e5f6071829"
CHAIN = (  # what node-domain writes by default: layer 3, layer 2, the node; the trainer picks the level
    f"topology.k8s.aws/network-node-layer-3={LAYER3},topology.k8s.aws/network-node-layer-2={LAYER2},"
    f"kubernetes.io/hostname={NODE}"
)


def pretrain(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {"PATH": os.environ["PATH"], "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [PYTHON, "-m", "pretrain", *argv], capture_output=True, text=True, env={**base, **(env or {})}, timeout=120
    )


def test_the_domain_is_the_network_layer_label_and_launch_uses_it(tmp_path: Path) -> None:
    topology = tmp_path / "run" / "topology"
    out = pretrain("node-domain", "--node", NODE, "--node-json", str(NODE_JSON), "--output", str(topology))
    assert out.returncode == 0, out.stderr
    assert topology.read_text().splitlines()[-1] == f"{NODE} {CHAIN}"
    # The trainer container's environment as the h100 overlay renders it, on pod 0 and pod 2.
    docs = build("overlays/h100")
    (pod,) = trainer_pods(docs)
    trainer = next(c for c in pod.spec["containers"] if c["name"] == "trainer")
    rendered = {k: v for k, v in env_of(trainer).items() if isinstance(v, str)}
    store_wait = env_configmap(docs)["RDZV_STORE_TIMEOUT"]
    for ordinal, is_host in ((0, 1), (2, 0)):
        env = {
            **rendered,
            "RDZV_STORE_TIMEOUT": store_wait,
            "HOSTNAME": f"pretrain-{ordinal}",
            "NODE_NAME": NODE,
            "TOPOLOGY_FILE": str(topology),  # the rendered path, /run/pretrain/topology, moved here
            "LOCAL_NVME": str(tmp_path),
        }
        assert rendered["TOPOLOGY_FILE"] == "/run/pretrain/topology"
        launch = pretrain(
            "launch", "--config", str(TINY), "--nproc-per-node", "8", "--dry-run",
            "--set", "data.global_batch_size=192", env=env,
        )  # fmt: skip
        assert launch.returncode == 0, launch.stderr
        assert f"node {ordinal}/4" in launch.stdout and f"domain {CHAIN}" in launch.stdout
        cmd = shlex.split(launch.stdout.splitlines()[-1])
        wait = f"store_connect_wait_seconds={store_wait},read_timeout={store_wait}"
        conf = f"--rdzv-conf=is_host={is_host},{wait},join_timeout={store_wait}"
        assert conf in cmd and "--rdzv-endpoint=pretrain-0.pretrain:29500" in cmd


def test_a_node_without_the_labels_falls_back_to_the_next_level_then_itself(tmp_path: Path) -> None:
    """A capacity reservation may show fewer network layers: the chain starts lower; a node with
    none of the labels is its own domain, said in one line (not an Init:Error)."""
    node = json.loads(NODE_JSON.read_text())
    del node["metadata"]["labels"]["topology.k8s.aws/network-node-layer-3"]
    recorded = tmp_path / "node.json"
    recorded.write_text(json.dumps(node))
    topology = tmp_path / "topology"
    out = pretrain("node-domain", "--node", NODE, "--node-json", str(recorded), "--output", str(topology))
    assert out.returncode == 0, out.stderr
    assert topology.read_text().splitlines()[-1] == f"{NODE} {CHAIN.split(',', 1)[1]}"
    del node["metadata"]["labels"]["topology.k8s.aws/network-node-layer-2"]
    recorded.write_text(json.dumps(node))
    out = pretrain("node-domain", "--node", NODE, "--node-json", str(recorded), "--output", str(topology))
    assert out.returncode == 0, out.stderr
    assert topology.read_text().splitlines()[-1] == f"{NODE} kubernetes.io/hostname={NODE}"
    fell = [x for x in out.stdout.splitlines() if "falls back" in x]
    assert len(fell) == 1 and "network-node-layer-3, topology.k8s.aws/network-node-layer-2" in fell[0], out.stdout


def test_the_first_configured_label_the_node_carries_wins(tmp_path: Path) -> None:
    topology = tmp_path / "topology"
    env = {"FAILURE_DOMAIN_LABEL": "example.com/rack, topology.kubernetes.io/zone"}
    out = pretrain("node-domain", "--node", NODE, "--node-json", str(NODE_JSON), "--output", str(topology), env=env)
    assert out.returncode == 0, out.stderr
    zone = f"topology.kubernetes.io/zone=us-east-1a,kubernetes.io/hostname={NODE}"
    assert topology.read_text().splitlines()[-1] == f"{NODE} {zone}"
    assert "label topology.kubernetes.io/zone" in out.stdout


def test_a_record_of_another_node_is_refused(tmp_path: Path) -> None:
    out = pretrain(
        "node-domain", "--node", "ip-10-9-9-9", "--node-json", str(NODE_JSON), "--output", str(tmp_path / "t")
    )
    assert out.returncode == 2 and "not 'ip-10-9-9-9'" in out.stderr


class NodeApi(BaseHTTPRequestHandler):
    """GET /api/v1/nodes/<name> for one bearer token, as the API server answers a bound ServiceAccount."""

    token = "sa-token-1"
    seen: list[str] = []  # noqa: RUF012 (one server per test)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.seen.append(self.path)
        if self.headers.get("Authorization") != f"Bearer {self.token}":
            self._answer(403, {"kind": "Status", "reason": "Forbidden"})
        elif self.path == f"/api/v1/nodes/{NODE}":
            self._answer(200, json.loads(NODE_JSON.read_text()))
        else:
            self._answer(404, {"kind": "Status", "reason": "NotFound"})

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def api_server() -> Iterator[str]:
    NodeApi.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), NodeApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_the_node_is_read_from_the_api_server_with_the_pods_token(api_server: str, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(NodeApi.token + "\n")
    topology = tmp_path / "topology"
    argv = ["node-domain", "--node", NODE, "--api-server", api_server, "--token-file", str(token)]
    out = pretrain(*argv, "--output", str(topology))
    assert out.returncode == 0, out.stderr
    assert topology.read_text().splitlines()[-1] == f"{NODE} {CHAIN}"
    assert NodeApi.seen == [f"/api/v1/nodes/{NODE}"], "exactly one GET of its own node, no list"
    # A ServiceAccount without the ClusterRoleBinding: the API server answers 403.
    token.write_text("unbound-token")
    topology.unlink()
    out = pretrain(*argv, "--output", str(topology))
    assert out.returncode == 2 and not topology.exists()
    (line,) = out.stderr.strip().splitlines()
    assert "HTTP 403" in line and "k8s/common/rbac.yaml" in line


def test_a_node_other_than_0_waits_rdzv_store_timeout_for_node_0s_store(tmp_path: Path) -> None:
    """Real ft_launcher: pod 1 with nobody serving the store gives up after RDZV_STORE_TIMEOUT, not
    NVRx's default (c10d's TCPStore client: "timed out after <read_timeout>ms while trying to connect")."""
    env = {
        "HOSTNAME": "pretrain-1",
        "NNODES": "2",
        "RDZV_HOST": "127.0.0.1",
        "RDZV_PORT": str(free_port()),  # node 0 never starts: nothing listens there
        "RDZV_STORE_TIMEOUT": "3",
        "NODE_NAME": NODE,
        "LOCAL_NVME": str(tmp_path),
        "TMPDIR": str(tmp_path),
        "RDZV_PRIVATE_NETWORK": "1",  # loopback: NVRx 0.4.1's pickled rendezvous allowed
    }
    argv = ["launch", "--config", str(TINY), "--nproc-per-node", "1", "--ft-config", str(FT_CPU)]
    out = pretrain(*argv, "--set", f"run.dir={tmp_path / 'runs'}", env=env)
    assert out.returncode != 0
    assert "is_host': '0', 'store_connect_wait_seconds': '3', 'read_timeout': '3'" in out.stderr + out.stdout
    assert "timed out after 3000ms while trying to connect" in out.stderr + out.stdout


@pytest.mark.parametrize("value", ["x", "0", "-5"])
def test_a_bad_store_timeout_is_refused_in_one_line(value: str, tmp_path: Path) -> None:
    env = {"HOSTNAME": "pretrain-1", "NNODES": "2", "RDZV_HOST": "pretrain-0.pretrain", "LOCAL_NVME": str(tmp_path)}
    with pytest.raises(LaunchError) as err:
        plan_from_env({**env, "RDZV_STORE_TIMEOUT": value})
    assert str(err.value).startswith("RDZV_STORE_TIMEOUT=") and "fix:" in str(err.value)
    conf = "is_host=0,store_connect_wait_seconds=1800,read_timeout=1800,join_timeout=1800"
    assert rendezvous_conf(plan_from_env(env)) == conf

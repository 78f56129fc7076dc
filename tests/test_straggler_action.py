"""``fault_tolerance.straggler.action: restart_without`` in one process: which node rank 0 excludes
after which reports (NVRx ``Report`` objects as the detector builds them), what the excluded-nodes
file holds, ``pretrain launch`` refusing an excluded node (on Kubernetes: the node tainted and the
pod deleted through an API server that answers as a bound, or an unbound, ServiceAccount), the
``--excluded-nodes`` list the sbatch requeue reads, and the start-time refusal of a layout that one
node fewer cannot hold."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from pretrain.commands.launch import launch
from pretrain.commands.node_domain import ApiServer
from pretrain.commands.node_taint import TAINT_KEY
from pretrain.config import StragglerConfig
from pretrain.errors import LaunchError, NodeExcluded
from pretrain.platform.compat import straggler_module
from pretrain.resilience.excluded_nodes import exclude, read_excluded, refusal
from pretrain.resilience.stragglers import FORWARD, StragglerWatch
from tests.helpers import PYTHON, REPO, TINY

FT_LAUNCHER = str(Path(PYTHON).with_name("ft_launcher"))
NODES = {0: "node-a", 1: "node-b", 2: "node-b", 3: "node-c"}


def nvrx_report(relative: dict[int, float]) -> Any:
    """NVRx's ``Report`` as rank 0 receives it (section scores only: a CPU host)."""
    return straggler_module().Report(
        gpu_relative_perf_scores={},
        section_relative_perf_scores={FORWARD: relative},
        gpu_individual_perf_scores={},
        section_individual_perf_scores={FORWARD: {r: 1.0 for r in relative}},
        rank_to_node={r: NODES[r] for r in relative},
        local_section_summaries={},
        local_kernel_summaries={},
        generate_report_elapsed_time=0.0,
        gather_on_rank0=True,
        rank=None,
    )


def watch(tmp_path: Path, action: str = "restart_without", patience: int = 2) -> StragglerWatch:
    cfg = StragglerConfig(enabled=False, threshold=0.5, patience=patience, action=action)

    def to_file(node: str, **evidence: Any) -> str:
        return str(exclude(tmp_path, node, **evidence))

    return StragglerWatch(cfg, 0, "node-a", lambda report: None, to_file, lambda obj, src=0: obj)


FAST = {0: 1.0, 1: 0.9, 2: 0.95, 3: 0.97}
B_SLOW = {0: 1.0, 1: 0.2, 2: 0.9, 3: 0.97}  # one rank of node-b slow: the node is
C_SLOWER = {0: 1.0, 1: 0.3, 2: 0.9, 3: 0.1}


@pytest.mark.parametrize(
    ("reports", "action", "excluded_at"),
    [
        ([FAST, B_SLOW, B_SLOW], "restart_without", {2: "node-b"}),
        ([B_SLOW, FAST, B_SLOW, FAST], "restart_without", {}),  # never twice in a row
        ([B_SLOW, C_SLOWER], "restart_without", {1: "node-b"}),  # node-c slow only once
        ([C_SLOWER, C_SLOWER], "restart_without", {1: "node-c"}),  # both persistent: the slowest
        ([B_SLOW, B_SLOW, B_SLOW], "report", {}),
    ],
)
def test_a_node_is_excluded_after_patience_slow_reports_in_a_row(
    tmp_path: Path, reports: list[dict[int, float]], action: str, excluded_at: dict[int, str]
) -> None:
    w = watch(tmp_path, action)
    decided = {}
    for i, scores in enumerate(reports):
        _, node = w.judge(10 * (i + 1), nvrx_report(scores))
        if node is not None:
            decided[i] = node
            break
    assert decided == excluded_at
    assert sorted(read_excluded(tmp_path)) == sorted(excluded_at.values())


def test_every_node_slow_excludes_none(tmp_path: Path) -> None:
    w = watch(tmp_path)
    one_node = {1: 0.2, 2: 0.1}  # node-b only: its ranks are slower than each other, nothing to restart on
    assert [w.judge(s, nvrx_report(one_node))[1] for s in (5, 10, 15)] == [None, None, None]
    assert read_excluded(tmp_path) == {}


def test_the_excluded_nodes_file_holds_the_evidence_and_the_refusal_names_node_file_and_fix(tmp_path: Path) -> None:
    w = watch(tmp_path)
    for step in (10, 20):
        w.judge(step, nvrx_report(B_SLOW))
    (record,) = read_excluded(tmp_path).values()
    assert record["node"] == "node-b" and record["step"] == 20 and record["ranks"] == [1, 2]
    assert [r["step"] for r in record["reports"]] == [10, 20] and record["reports"][1]["relative"]["1"] == 0.2
    assert "relative score 0.20 < fault_tolerance.straggler.threshold=0.5" in record["reason"]
    exclude(tmp_path, "node-c", reason="Xid 79")  # a second node: both kept, one line each
    lines = (tmp_path / "excluded-nodes.jsonl").read_text().splitlines()
    assert [json.loads(x)["node"] for x in lines] == ["node-b", "node-c"]
    line = refusal(tmp_path, "node-b")
    assert line is not None and "\n" not in line
    assert "node node-b is excluded" in line and str(tmp_path / "excluded-nodes.jsonl") in line and "fix:" in line
    assert refusal(tmp_path, "node-a") is None


class Api(BaseHTTPRequestHandler):
    """The API server for one node and one pod, answering a bound ServiceAccount's token only."""

    token = "bound"
    calls: list[tuple[str, str, Any]] = []  # noqa: RUF012 (one server per test)
    node: dict[str, Any] = {}  # noqa: RUF012

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length)) if length else None

    def _handle(self) -> None:
        body = self._body()
        self.calls.append((self.command, self.path, body))
        if self.headers.get("Authorization") != f"Bearer {self.token}":
            return self._answer(403, {"kind": "Status", "reason": "Forbidden"})
        if self.path == "/api/v1/nodes/node-b" and self.command == "GET":
            return self._answer(200, self.node)
        if self.path == "/api/v1/nodes/node-b" and self.command == "PATCH":
            assert self.headers["Content-Type"] == "application/merge-patch+json"
            if body["metadata"]["resourceVersion"] != self.node["metadata"]["resourceVersion"]:
                return self._answer(409, {"kind": "Status", "reason": "Conflict"})
            self.node["spec"]["taints"] = body["spec"]["taints"]
            return self._answer(200, self.node)
        if self.path == "/api/v1/namespaces/train/pods/pretrain-1" and self.command == "DELETE":
            return self._answer(200, {"kind": "Pod"})
        return self._answer(404, {"kind": "Status", "reason": "NotFound"})

    do_GET = do_PATCH = do_DELETE = _handle  # noqa: N815 (http.server's names)

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def api_url() -> Iterator[str]:
    Api.calls = []
    other = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    Api.node = {"metadata": {"name": "node-b", "resourceVersion": "7"}, "spec": {"taints": [other]}}
    server = ThreadingHTTPServer(("127.0.0.1", 0), Api)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def k8s_env(tmp_path: Path, nnodes: int = 2) -> dict[str, str]:
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    return {
        "HOSTNAME": "pretrain-1",
        "POD_NAME": "pretrain-1",
        "POD_NAMESPACE": "train",
        "NODE_NAME": "node-b",
        "NNODES": str(nnodes),
        "LOCAL_NVME": str(nvme),
        "RUN_ID": "t",
    }


def _launch(tmp_path: Path, env: dict[str, str], api: ApiServer | None, dry_run: bool = False, *sets: str) -> int:
    over = [f"run.dir={tmp_path / 'runs'}", *sets]
    return launch(str(TINY), 1, 1, "ft.yaml", dry_run, over, env=env, launcher=FT_LAUNCHER, api=api)


def test_launch_on_an_excluded_node_taints_it_deletes_its_pod_and_refuses(tmp_path: Path, api_url: str) -> None:
    exclude(tmp_path / "runs" / "t", "node-b", reason="slow in 3 straggler reports in a row")
    token = tmp_path / "token"
    token.write_text("bound")
    api = ApiServer(api_url, token, None)
    with pytest.raises(NodeExcluded) as err:
        _launch(tmp_path, k8s_env(tmp_path), api, True)  # a dry run asks nothing of the API server
    assert Api.calls == [] and "node node-b is excluded" in str(err.value)
    Api.node["metadata"]["resourceVersion"] = "8"  # the taint PATCH must carry the version it read
    with pytest.raises(NodeExcluded) as err:
        _launch(tmp_path, k8s_env(tmp_path), api)
    line = str(err.value)
    assert "\n" not in line and "fix:" in line, line
    assert f"node node-b tainted {TAINT_KEY}=t:NoSchedule" in line and "pod train/pretrain-1 deleted" in line
    assert [(m, p) for m, p, _ in Api.calls] == [
        ("GET", "/api/v1/nodes/node-b"),
        ("PATCH", "/api/v1/nodes/node-b"),
        ("DELETE", "/api/v1/namespaces/train/pods/pretrain-1"),
    ]
    keys = [t["key"] for t in Api.node["spec"]["taints"]]
    assert keys == ["nvidia.com/gpu", TAINT_KEY], "the node's other taints are kept"
    # Without the RBAC: the launch is refused all the same, and the line says what was not done.
    token.write_text("unbound")
    with pytest.raises(NodeExcluded) as err:
        _launch(tmp_path, k8s_env(tmp_path), api)
    assert (
        "not done: GET" in str(err.value) and "HTTP 403" in str(err.value) and "k8s/cluster/rbac.yaml" in str(err.value)
    )


def test_launch_on_another_node_and_the_sbatch_list_of_excluded_nodes(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "t"
    env = {**k8s_env(tmp_path), "NODE_NAME": "node-a"}
    assert _launch(tmp_path, env, None, True) == 0
    exclude(run, "node-b", reason="slow")
    exclude(run, "node-c", reason="slow")
    assert _launch(tmp_path, env, None, True) == 0
    out = subprocess.run(
        [
            PYTHON,
            "-m",
            "pretrain",
            "launch",
            "--config",
            str(TINY),
            "--excluded-nodes",
            "--set",
            f"run.dir={run.parent}",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "RUN_ID": "t"},
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "node-b,node-c", out.stderr


def test_restart_without_is_refused_at_start_when_one_node_fewer_cannot_hold_the_layout(tmp_path: Path) -> None:
    sets = ("fault_tolerance.straggler.action=restart_without", "data.global_batch_size=12")
    # 12 samples of micro-batch 2: dp 1, 2, 3, 6 fit; on 3 nodes one fewer (2) fits, on 6 one fewer (5) does not.
    assert _launch(tmp_path, {**k8s_env(tmp_path, 3), "NODE_NAME": "node-a"}, None, True, *sets) == 0
    with pytest.raises(LaunchError) as err:
        _launch(tmp_path, {**k8s_env(tmp_path, 6), "NODE_NAME": "node-a"}, None, True, *sets)
    line = str(err.value)
    assert "\n" not in line and "fault_tolerance.straggler.action: restart_without on 6 node(s)" in line, line
    assert "would restart on 5" in line and "fix: use action: report" in line and ": 2, 3, 4, 7" in line, line
    # One node: it is never excluded (nothing would remain), so the job on its last node starts.
    assert (
        _launch(tmp_path, {**k8s_env(tmp_path, 1), "HOSTNAME": "pretrain-0", "NODE_NAME": "node-a"}, None, True, *sets)
        == 0
    )

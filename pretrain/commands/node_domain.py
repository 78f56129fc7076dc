"""``pretrain node-domain``: this pod's node's failure domain, read from the node's own labels.

Owns one step of a Kubernetes trainer pod's start: the init container ``node-domain``
(k8s/base/statefulset.yaml, k8s/jobset/jobset.yaml) asks the API server for its Node (RBAC: ``get
nodes``, k8s/cluster/rbac.yaml) and writes ``<node> <domain>`` into the topology file that
``pretrain launch`` reads (``TOPOLOGY_FILE``; see pretrain/commands/launch.py). Pods do not carry
their node's labels, so the downward API cannot give this.

The domain is a chain, not one value: every configured label the node carries, in order (default
EKS's ``network-node-layer-3`` then ``-layer-2``), then ``kubernetes.io/hostname=<node>``, e.g.
``topology.k8s.aws/network-node-layer-3=nn-1,topology.k8s.aws/network-node-layer-2=nn-2,
kubernetes.io/hostname=ip-1``. Only the trainer sees every node, so it picks the level
(:func:`tiering.peer.placement.resolve_domains`): a job under one layer-3 switch, or with a node whose
capacity reservation shows fewer layers, falls back to the next level, then the node, in one
line. A node carrying none of the labels is therefore not refused: its chain is the node alone,
and this command says so in its line. It never lists nodes (it reads exactly one) and writes
nothing but the topology file, atomically. ``--node-json`` reads a recorded Node instead of the
API server (tests, drills, clusters without RBAC for it).
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.errors import LaunchError, NodeLaunchError

# The bottom layers of the EC2 network topology for most instance types (EKS user guide, "Place
# distributed AI/ML workloads with network topology labels"): nodes sharing layer 3 share a switch.
DEFAULT_LABEL = "topology.k8s.aws/network-node-layer-3,topology.k8s.aws/network-node-layer-2"
HOSTNAME_LABEL = "kubernetes.io/hostname"  # the last level of every chain: the node itself
SERVICEACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class ApiRefused(LaunchError):
    """The API server answered with an HTTP error (``status``)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ApiServer:
    """Where and as whom to read a Node: the in-cluster API server and the pod's ServiceAccount."""

    url: str
    token_file: Path
    ca_file: Path | None

    @classmethod
    def in_cluster(cls, env: Mapping[str, str]) -> ApiServer:
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise LaunchError(
                "KUBERNETES_SERVICE_HOST is not set (not in a pod); fix: pass --node-json or --api-server"
            )
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", SERVICEACCOUNT / "token", SERVICEACCOUNT / "ca.crt")

    def get_node(self, name: str, timeout_s: float = 30.0) -> dict[str, Any]:
        return self.call("GET", f"/api/v1/nodes/{urllib.parse.quote(name, safe='')}", timeout_s=timeout_s)

    def call(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout_s: float = 30.0
    ) -> dict[str, Any]:
        """One request as the pod's ServiceAccount; a JSON merge patch for PATCH. ApiRefused (one
        line with the fix, and the HTTP status) when the API server says no; LaunchError when it
        cannot be reached."""
        url = f"{self.url.rstrip('/')}{path}"
        try:
            token = self.token_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise LaunchError(
                f"{self.token_file}: cannot read the ServiceAccount token ({exc.strerror}); fix: keep "
                "automountServiceAccountToken on for the trainer pod"
            ) from exc
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/merge-patch+json" if method == "PATCH" else "application/json"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        context = ssl.create_default_context(cafile=str(self.ca_file)) if url.startswith("https:") else None
        try:
            with urllib.request.urlopen(request, timeout=timeout_s, context=context) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            fix = {
                401: "the ServiceAccount token was rejected; check the pod's serviceAccountName",
                403: "bind the pod's ServiceAccount to a role allowing it "
                "(k8s/cluster/rbac.yaml: nodes; k8s/common/rbac.yaml: pods)",
                404: "NODE_NAME must come from the downward API fieldRef spec.nodeName",
            }.get(exc.code, "check the API server")
            raise ApiRefused(f"{method} {url}: HTTP {exc.code} {exc.reason}; fix: {fix}", exc.code) from exc
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise NodeLaunchError(f"{method} {url}: {reason}; fix: check the pod can reach the API server") from exc


def read_node_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LaunchError(f"{path}: not a readable Node JSON ({exc}); fix: `kubectl get node NAME -o json`") from exc


def domain_of(node: Mapping[str, Any], labels: Sequence[str]) -> tuple[str, str]:
    """(the first of ``labels`` the node carries, or the hostname label; the domain chain: each
    carried label as ``label=value`` in order, then the node). Never refuses a node for a label."""
    meta = node.get("metadata", {})
    have = meta.get("labels") or {}
    name = meta.get("name", "?")
    chain = [(label, have[label]) for label in labels if have.get(label)]
    if HOSTNAME_LABEL not in dict(chain):
        chain.append((HOSTNAME_LABEL, name))
    for _, value in chain:
        if not value or any(c in value for c in ",= \t"):
            raise LaunchError(f"node {name}: label value {value!r} cannot name a domain; fix: relabel the node")
    return chain[0][0], ",".join(f"{label}={value}" for label, value in chain)


def write_topology(path: Path, node: str, domain: str) -> None:
    """``<node> <domain>``, replacing the file in one rename (the launcher never reads half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"# written by pretrain node-domain from node {node}'s labels\n{node} {domain}\n", encoding="utf-8")
    os.replace(tmp, path)


def labels_from(values: Sequence[str] | None, env: Mapping[str, str]) -> list[str]:
    """``--label`` values, else ``FAILURE_DOMAIN_LABEL`` (comma-separated, preferred first), else EKS's."""
    raw = list(values or []) or (env.get("FAILURE_DOMAIN_LABEL") or DEFAULT_LABEL).split(",")
    return [label.strip() for label in raw if label.strip()]


def node_domain(
    node_name: str, labels: Sequence[str], output: Path, *, node_json: Path | None = None, api: ApiServer | None = None
) -> tuple[str, str]:
    """Read the node (recorded JSON, else the API server), write the topology file; (label, domain)."""
    if not node_name:
        raise LaunchError("NODE_NAME is not set; fix: map it from the downward API fieldRef spec.nodeName")
    if node_json is not None:
        node = read_node_json(node_json)
    else:
        node = (api or ApiServer.in_cluster(os.environ)).get_node(node_name)
    recorded = node.get("metadata", {}).get("name")
    if recorded != node_name:
        raise LaunchError(f"node record names {recorded!r}, not {node_name!r}; fix: record the pod's own node")
    label, domain = domain_of(node, labels)
    write_topology(output, node_name, domain)
    return label, domain

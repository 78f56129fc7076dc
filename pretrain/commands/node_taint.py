"""Keeping an excluded node out of a Kubernetes job: taint the node, hand the pod back to the scheduler.

Called by ``pretrain launch`` when it refuses to start on a node the run's excluded-nodes file
names (a persistent straggler, :mod:`pretrain.resilience.excluded_nodes`) on Kubernetes. A
container that merely exits is restarted in the same pod on the same node, so :func:`keep_off`

1. adds the taint ``resilient-pretrain/excluded=<run id>:NoSchedule`` to the node (GET, then a JSON
   merge patch of ``spec.taints`` carrying the read ``resourceVersion``: a concurrent change of the
   node's taints makes it retry instead of overwriting them), so no new pod of the job is placed
   there, and
2. deletes its own pod, so its StatefulSet or JobSet creates it again on another node.

RBAC (k8s/cluster/rbac.yaml: ``get``/``patch`` on nodes; k8s/common/rbac.yaml: ``delete`` on pods) for the trainer's
ServiceAccount. Where the account may not, the refusal line says which step was refused and the
fix; nothing else is attempted. It never lists nodes or pods and never removes a taint: a person
does, once the node is repaired (``kubectl taint node NODE resilient-pretrain/excluded-``).
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping

from pretrain.commands.node_domain import SERVICEACCOUNT, ApiRefused, ApiServer
from pretrain.errors import LaunchError

TAINT_KEY = "resilient-pretrain/excluded"
EFFECT = "NoSchedule"


def taint_value(run_id: str) -> str:
    """A label value (63 characters of [A-Za-z0-9_.-], alphanumeric at both ends) for the run id."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", run_id)[:63].strip("-_.") or "run"


def taint_node(api: ApiServer, node: str, run_id: str, tries: int = 3) -> str:
    """Add the exclusion taint to ``node`` (kept if already there); what was done, in words."""
    path = f"/api/v1/nodes/{urllib.parse.quote(node, safe='')}"
    value = taint_value(run_id)
    for _ in range(tries):
        record = api.call("GET", path)
        taints = list((record.get("spec") or {}).get("taints") or [])
        if any(t.get("key") == TAINT_KEY and t.get("effect") == EFFECT for t in taints):
            return f"node {node} already carries the {TAINT_KEY} taint"
        taints.append({"key": TAINT_KEY, "value": value, "effect": EFFECT})
        version = record.get("metadata", {}).get("resourceVersion")
        try:
            api.call("PATCH", path, {"metadata": {"resourceVersion": version}, "spec": {"taints": taints}})
        except ApiRefused as exc:
            if exc.status == 409:  # the node changed since the GET: read it again
                continue
            raise
        return f"node {node} tainted {TAINT_KEY}={value}:{EFFECT}"
    raise LaunchError(f"node {node}: its taints kept changing ({tries} tries); fix: taint it by hand")


def pod_namespace(env: Mapping[str, str]) -> str:
    if env.get("POD_NAMESPACE"):
        return env["POD_NAMESPACE"]
    try:
        return (SERVICEACCOUNT / "namespace").read_text(encoding="utf-8").strip()
    except OSError:
        return "default"


def keep_off(env: Mapping[str, str], node: str, run_id: str, api: ApiServer | None = None) -> str:
    """Taint ``node`` and delete this pod; a summary for the refusal line (never raises for a
    refusal of the API server: the launch is refused either way, and says what did not happen)."""
    done = []
    try:
        api = api or ApiServer.in_cluster(env)
        done.append(taint_node(api, node, run_id))
        pod = env.get("POD_NAME") or env.get("HOSTNAME", "")
        namespace = pod_namespace(env)
        api.call("DELETE", f"/api/v1/namespaces/{namespace}/pods/{urllib.parse.quote(pod, safe='')}")
        done.append(f"pod {namespace}/{pod} deleted: its controller recreates it on another node")
    except LaunchError as exc:
        done.append(f"not done: {exc}")
    return "; ".join(done)

"""The Kubernetes deployment: every overlay built with kustomize and validated offline against the
Kubernetes OpenAPI schemas in strict mode; the JobSet against its CRD's schema; cross-object
consistency (replicas = NNODES, grace period > emergency save, configs that load); the IAM policy."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pretrain.config import load_config, validate
from tests.helpers import REPO

K8S = REPO / "k8s"
OVERLAYS = ["overlays/cpu-smoke", "overlays/h100", "overlays/h100-jobset"]
K8S_VERSION = "1.33.0"
CRD_KINDS = {"JobSet", "PrometheusRule", "PodMonitor"}


def build(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (for `kubectl kustomize`) is not installed"
    out = subprocess.run([kubectl, "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def env_configmap(docs: list[dict[str, Any]]) -> dict[str, str]:
    return next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith("pretrain-env"))["data"]


def job_of(jobset: dict[str, Any], i: int = 0) -> dict[str, Any]:
    rj = jobset["spec"]["replicatedJobs"][i]
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": rj["name"]}, "spec": rj["template"]["spec"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_manifest_validates_strictly(overlay: str) -> None:
    docs = build(overlay)
    kinds = {d["kind"] for d in docs}
    assert {"ServiceAccount", "ConfigMap", "Deployment", "PersistentVolumeClaim", "PrometheusRule"} <= kinds
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    schema = json.loads((K8S / "schemas" / "jobset.x-k8s.io_v1alpha2.schema.json").read_text())
    for js in by_kind(docs, "JobSet"):
        jsonschema.validate(js, schema)
        for i in range(len(js["spec"]["replicatedJobs"])):
            kubernetes_validate.validate(job_of(js, i), K8S_VERSION, strict=True)


def test_strict_validation_rejects_unknown_fields() -> None:
    """The validators above can fail: a misspelt field is an error, in core kinds and the JobSet."""
    docs = build("overlays/h100")
    sts = copy.deepcopy(by_kind(docs, "StatefulSet")[0])
    sts["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 60
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, K8S_VERSION, strict=True)
    js = copy.deepcopy(by_kind(build("overlays/h100-jobset"), "JobSet")[0])
    js["spec"]["failurePolicy"]["maxRestart"] = 3
    schema = json.loads((K8S / "schemas" / "jobset.x-k8s.io_v1alpha2.schema.json").read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(js, schema)
    bad_job = job_of(by_kind(build("overlays/h100-jobset"), "JobSet")[0])
    bad_job["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad_job, K8S_VERSION, strict=True)


@pytest.mark.parametrize(("overlay", "nodes", "gpus"), [("overlays/cpu-smoke", 2, None), ("overlays/h100", 4, "8")])
def test_statefulset_shape(overlay: str, nodes: int, gpus: str | None, tmp_path: Path) -> None:
    docs = build(overlay)
    sts = by_kind(docs, "StatefulSet")[0]
    svc = next(s for s in by_kind(docs, "Service") if s["metadata"]["name"] == sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    spec, pod = sts["spec"], sts["spec"]["template"]["spec"]
    assert spec["podManagementPolicy"] == "Parallel" and spec["replicas"] == nodes
    trainer = next(c for c in pod["containers"] if c["name"] == "trainer")
    env = env_of(trainer)
    assert env["NNODES"] == str(nodes), "NNODES must equal the replica count"
    assert env["RDZV_HOST"] == f"{sts['metadata']['name']}-0.{svc['metadata']['name']}"
    assert env["FAILURE_DOMAIN"] == {"fieldRef": {"fieldPath": "metadata.labels['topology.kubernetes.io/zone']"}}
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert pod["topologySpreadConstraints"][0]["topologyKey"] == "topology.kubernetes.io/zone"
    limits = trainer["resources"].get("limits", {})
    assert limits.get("nvidia.com/gpu") == gpus and trainer["resources"]["requests"].get("nvidia.com/gpu") == gpus
    nvme = next(v for v in pod["volumes"] if v["name"] == "nvme")
    assert "hostPath" in nvme or "emptyDir" in nvme
    assert [c["name"] for c in pod["initContainers"]][-1] == "restore"
    restore = pod["initContainers"][-1]
    assert "tiering restore" in restore["args"][0] and "--allow-none" in restore["args"][0]
    # The config the pods read loads, validates at this world size, and fits the grace period.
    cm = next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith("pretrain-config"))
    assert any(v["configMap"]["name"] == cm["metadata"]["name"] for v in pod["volumes"] if "configMap" in v)
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(cm["data"]["config.yaml"])
    cfg = load_config(cfg_path)
    nproc = int(env_configmap(docs)["NPROC_PER_NODE"])
    if gpus is None:
        validate(cfg, nodes * nproc, cuda=False)
    assert cfg.checkpoint.local.dir == "/nvme" and cfg.checkpoint.reshardable.dir.startswith("/staging")
    assert pod["terminationGracePeriodSeconds"] > cfg.fault_tolerance.emergency_save_timeout + 10
    assert env_configmap(docs)["RUN_ID"] == cfg.run.id
    assert yaml.safe_load(cm["data"]["ft.yaml"])["fault_tolerance"]["rank_heartbeat_timeout"] > 0
    # The uploader is its own Deployment, reading the same staging volume.
    up = next(d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "pretrain-uploader")
    up_pod = up["spec"]["template"]["spec"]
    assert up_pod["containers"][0]["command"][:3] == ["pretrain", "upload", "--config"]
    assert "--watch" in up_pod["containers"][0]["command"] and up["spec"]["strategy"]["type"] == "Recreate"
    claims = {v["persistentVolumeClaim"]["claimName"] for v in up_pod["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    pvc = by_kind(docs, "PersistentVolumeClaim")[0]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and pvc["spec"].get("storageClassName")
    sa = by_kind(docs, "ServiceAccount")[0]
    assert sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].startswith("arn:aws:iam::")
    assert pod["serviceAccountName"] == up_pod["serviceAccountName"] == sa["metadata"]["name"]


def test_jobset_restarts_the_whole_group_and_stops_on_config_errors() -> None:
    docs = build("overlays/h100-jobset")
    js = by_kind(docs, "JobSet")[0]
    policy = js["spec"]["failurePolicy"]
    assert policy["maxRestarts"] > 0 and policy["restartStrategy"] == "Recreate"
    job = job_of(js)["spec"]
    assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"
    assert job["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] == [2]
    assert policy["rules"][0]["action"] == "FailJobSet"
    trainer = job["template"]["spec"]["containers"][0]
    env = env_of(trainer)
    assert env["NNODES"] == str(js["spec"]["replicatedJobs"][0]["replicas"]) == "4"
    assert env["NODE_RANK"] == {"fieldRef": {"fieldPath": "metadata.annotations['jobset.sigs.k8s.io/job-index']"}}
    assert env["RDZV_HOST"] == f"pretrain-trainer-0-0.{js['spec']['network']['subdomain']}"
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_prometheus_rule_is_the_promtool_tested_rules_file() -> None:
    for overlay in OVERLAYS:
        docs = build(overlay)
        rule = by_kind(docs, "PrometheusRule")[0]
        assert rule["spec"]["groups"] == yaml.safe_load((REPO / "monitoring" / "alerts.yaml").read_text())["groups"]
        monitor = by_kind(docs, "PodMonitor")[0]
        assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
        assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "trainer"


def test_iam_policy_grants_only_the_run_prefix() -> None:
    policy = json.loads((K8S / "common" / "iam-policy.json").read_text())
    for role in ("Writer", "Reader", "Gc"):
        for st in policy[role]["Statement"]:
            assert st["Effect"] == "Allow"
            actions = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
            assert all(a.startswith("s3:") and "*" not in a for a in actions), st
            for res in st["Resource"]:
                if res == "arn:aws:s3:::BUCKET":  # bucket-level: listing, limited to the run prefix
                    assert set(actions) <= {"s3:ListBucket", "s3:ListBucketMultipartUploads"}
                    assert st["Condition"]["StringLike"]["s3:prefix"] == ["PREFIX/RUN_ID/*"]
                else:
                    assert res.startswith("arn:aws:s3:::BUCKET/PREFIX/RUN_ID/"), res
    writer = {a for st in policy["Writer"]["Statement"] for a in st["Action"]}
    assert "s3:DeleteObject" not in writer, "the trainer/uploader role must not delete: only the gc identity does"
    reader = {a for st in policy["Reader"]["Statement"] for a in st["Action"]}
    assert reader <= {"s3:GetObject", "s3:ListBucket"}
    gc = {a for st in policy["Gc"]["Statement"] for a in st["Action"]}
    assert "s3:DeleteObject" in gc and "s3:PutObject" in writer

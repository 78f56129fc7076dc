"""The Kubernetes deployment: every overlay built with kustomize and validated offline against the
Kubernetes OpenAPI schemas in strict mode; the JobSet against its CRD's schema; cross-object
consistency (replicas = NNODES, grace period > emergency save, configs that load, every name a pod
references exists in the render, paths the pods share with the config); what a trainer pod needs
from its node (/dev/shm in memory, the NVMe mount, no hostPath that creates its directory, tier 0
in a memory volume sized by `pretrain plan`, EKS node selection any provisioner matches); failure
domains from node labels; lifecycle (OnDelete, a PDB that lets drains through, priority that
never preempts, disruptions not counted, exit codes, BlockingRecreate, dead-node tolerations, a
finished run stays finished); per-overlay namespaces and cluster-scoped names; the job's network
policy, the admission policy on the trainer's node and pod writes, tokens only where used, a
read-only root and dropped privileges on every container; the IAM policy."""

from __future__ import annotations

import copy
import fnmatch
import functools
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pretrain.commands.plan import plan_memory_tier
from pretrain.commands.plan_model import model_size
from pretrain.config import load_config, validate
from tests.helpers import REPO

K8S = REPO / "k8s"
OVERLAYS = ["overlays/cpu-smoke", "overlays/h100", "overlays/h100-jobset"]
K8S_VERSION = "1.33.0"
CRD_KINDS = {"JobSet", "PrometheusRule", "PodMonitor"}


@functools.cache
def render(overlay: str) -> str:
    """``kubectl kustomize`` of one overlay, once per test session (the tree does not change under it)."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (for `kubectl kustomize`) is not installed"
    out = subprocess.run([kubectl, "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def build(overlay: str) -> list[dict[str, Any]]:
    """The render's objects, parsed afresh for every caller (tests may modify them)."""
    return [d for d in yaml.safe_load_all(render(overlay)) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def env_configmap(docs: list[dict[str, Any]]) -> dict[str, str]:
    return next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith("pretrain-env"))["data"]


def pod_config(docs: list[dict[str, Any]], tmp_path: Path) -> Any:
    """The training config the render's pods read (the pretrain-config ConfigMap), loaded."""
    cm = next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith("pretrain-config"))
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"])
    return load_config(path)


TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def token_mounted(container: dict[str, Any]) -> bool:
    return any(m["mountPath"] == TOKEN_DIR for m in container.get("volumeMounts", []))


@dataclass
class PodTemplate:
    """A pod template of the render, whoever owns it (StatefulSet, JobSet, Deployment, CronJob)."""

    owner: str  # Kind/name
    metadata: dict[str, Any]
    spec: dict[str, Any]

    @property
    def component(self) -> str:
        return self.metadata.get("labels", {}).get("app.kubernetes.io/component", "")

    def labels(self, index: int) -> dict[str, str]:
        """The labels pod ``index`` carries: the template's plus those its controller adds."""
        kind, name = self.owner.split("/")
        extra = {
            "StatefulSet": {"statefulset.kubernetes.io/pod-name": f"{name}-{index}"},
            "JobSet": {"jobset.sigs.k8s.io/job-index": str(index)},
        }.get(kind, {})
        return {**self.metadata.get("labels", {}), **extra}

    def containers(self) -> list[dict[str, Any]]:
        return [*self.spec.get("initContainers", []), *self.spec["containers"]]


def pod_templates(docs: list[dict[str, Any]]) -> list[PodTemplate]:
    out = []
    for d in docs:
        owner, spec = f"{d['kind']}/{d['metadata']['name']}", d.get("spec", {})
        if d["kind"] in ("StatefulSet", "Deployment", "Job"):
            templates = [spec["template"]]
        elif d["kind"] == "CronJob":
            templates = [spec["jobTemplate"]["spec"]["template"]]
        elif d["kind"] == "JobSet":
            templates = [rj["template"]["spec"]["template"] for rj in spec["replicatedJobs"]]
        else:
            continue
        out += [PodTemplate(owner, t.get("metadata", {}), t["spec"]) for t in templates]
    return out


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "only matchLabels selectors are checked here"
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def trainer_pods(docs: list[dict[str, Any]]) -> list[PodTemplate]:
    pods = [t for t in pod_templates(docs) if t.component == "trainer"]
    assert pods, "no trainer pod template in the render"
    return pods


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
    assert "FAILURE_DOMAIN" not in env and env["TOPOLOGY_FILE"].startswith("/run/pretrain/")
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert "topologySpreadConstraints" not in pod, "EFA needs one zone: no zone spread"
    limits = trainer["resources"].get("limits", {})
    assert limits.get("nvidia.com/gpu") == gpus and trainer["resources"]["requests"].get("nvidia.com/gpu") == gpus
    nvme = next(v for v in pod["volumes"] if v["name"] == "nvme")
    assert "hostPath" in nvme or "emptyDir" in nvme
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
    roles = {
        sa["metadata"]["name"]: sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"]
        for sa in by_kind(docs, "ServiceAccount")
    }
    assert roles[pod["serviceAccountName"]].endswith("-reader") and roles[up_pod["serviceAccountName"]].endswith(
        "-writer"
    )


def exit_code_action(rules: list[dict[str, Any]], code: int) -> str:
    """What a Job's podFailurePolicy does with a trainer container exiting ``code`` (first match;
    no match: the failure counts against backoffLimit)."""
    for rule in rules:
        on = rule.get("onExitCodes")
        if on and on.get("containerName") in (None, "trainer"):
            hit = code in on["values"]
            if hit == (on["operator"] == "In"):
                return str(rule["action"])
    return "Count"


def test_jobset_restarts_the_whole_group_and_stops_only_on_run_level_stops() -> None:
    """`pretrain launch` exits 2 for a run-level stop (config error, stopped run: end the JobSet)
    and 3 for a node-local error (a counted restart, placed again); BlockingRecreate: no new pod
    starts while the previous generation's pod 0 (the rendezvous store) still runs."""
    docs = build("overlays/h100-jobset")
    js = by_kind(docs, "JobSet")[0]
    policy = js["spec"]["failurePolicy"]
    assert policy["maxRestarts"] > 0 and policy["restartStrategy"] == "BlockingRecreate"
    job = job_of(js)["spec"]
    assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"
    rules = job["podFailurePolicy"]["rules"]
    assert exit_code_action(rules, 2) == "FailJob"
    assert exit_code_action(rules, 3) == "Count" and exit_code_action(rules, 1) == "Count"
    assert policy["rules"] == [
        {"name": policy["rules"][0]["name"], "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}
    ]
    trainer = job["template"]["spec"]["containers"][0]
    env = env_of(trainer)
    assert env["NNODES"] == str(js["spec"]["replicatedJobs"][0]["replicas"]) == "4"
    assert env["NODE_RANK"] == {"fieldRef": {"fieldPath": "metadata.annotations['jobset.sigs.k8s.io/job-index']"}}
    assert env["RDZV_HOST"] == f"pretrain-trainer-0-0.{js['spec']['network']['subdomain']}"
    restart = {"fieldRef": {"fieldPath": "metadata.labels['jobset.sigs.k8s.io/restart-attempt']"}}
    assert env["RESTART_COUNT"] == restart, "attempt records carry the JobSet's restart attempt"
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_prometheus_rule_is_the_promtool_tested_rules_file() -> None:
    for overlay in OVERLAYS:
        docs = build(overlay)
        rule = by_kind(docs, "PrometheusRule")[0]
        assert rule["spec"]["groups"] == yaml.safe_load((REPO / "monitoring" / "alerts.yaml").read_text())["groups"]
        monitors = {
            m["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]: m for m in by_kind(docs, "PodMonitor")
        }
        assert set(monitors) == {"trainer", "uploader"}
        for component, monitor in monitors.items():
            # Every selected pod serves the endpoint's port: no target is down by design.
            port = monitor["spec"]["podMetricsEndpoints"][0]["port"]
            selected = [t for t in pod_templates(docs) if matches(monitor["spec"]["selector"], t.labels(0))]
            assert [t.owner for t in selected] == [t.owner for t in pod_templates(docs) if t.component == component]
            for t in selected:
                assert any(p["name"] == port for c in t.spec["containers"] for p in c.get("ports", []))
            if component == "trainer":  # only global rank 0 serves training metrics: pod 0 only
                (t,) = selected
                assert not matches(monitor["spec"]["selector"], t.labels(1)), "the PodMonitor must select pod 0 only"


def test_iam_policy_grants_only_the_run_prefix() -> None:
    policy = json.loads((K8S / "common" / "iam-policy.json").read_text())
    for role in ("Writer", "Reader", "Gc"):
        for st in policy[role]["Statement"]:
            assert st["Effect"] == "Allow"
            actions = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
            assert all(a.startswith("s3:") and "*" not in a for a in actions), st
            for res in st["Resource"]:
                if res == "arn:aws:s3:::BUCKET" and actions == ["s3:ListBucketMultipartUploads"]:
                    assert "Condition" not in st  # it has no s3:prefix key: a condition on it never applies
                elif res == "arn:aws:s3:::BUCKET":  # bucket-level: listing, limited to the run prefix
                    assert actions == ["s3:ListBucket"]
                    assert st["Condition"] == {"StringLike": {"s3:prefix": ["PREFIX/RUN_ID/*"]}}
                else:
                    assert res.startswith("arn:aws:s3:::BUCKET/PREFIX/RUN_ID/"), res
    writer = {a for st in policy["Writer"]["Statement"] for a in st["Action"]}
    assert "s3:DeleteObject" not in writer, "the trainer/uploader role must not delete: only the gc identity does"
    reader = {a for st in policy["Reader"]["Statement"] for a in st["Action"]}
    assert reader == {"s3:GetObject", "s3:ListBucket"}, "the trainer's role only reads"
    gc = {a for st in policy["Gc"]["Statement"] for a in st["Action"]}
    assert "s3:DeleteObject" in gc and "s3:PutObject" in writer


def volume_references(volumes: list[dict[str, Any]]) -> set[tuple[str, str]]:
    refs = set()
    for v in volumes:
        if "configMap" in v:
            refs.add(("ConfigMap", v["configMap"]["name"]))
        if "secret" in v:
            refs.add(("Secret", v["secret"]["secretName"]))
        if "persistentVolumeClaim" in v:
            refs.add(("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]))
        for src in v.get("projected", {}).get("sources", []):
            refs |= {
                (kind, src[key]["name"])
                for key, kind in (("configMap", "ConfigMap"), ("secret", "Secret"))
                if key in src
            }
    return refs


def container_references(container: dict[str, Any]) -> set[tuple[str, str]]:
    refs = set()
    for src in container.get("envFrom", []):
        refs |= {
            (kind, src[key]["name"])
            for key, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret"))
            if key in src and not src[key].get("optional", False)
        }
    for e in container.get("env", []):
        source = e.get("valueFrom", {})
        refs |= {
            (kind, source[key]["name"])
            for key, kind in (("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret"))
            if key in source
        }
    return refs


def references(pod: PodTemplate) -> set[tuple[str, str]]:
    """(kind, name) of every object the pod names: ConfigMaps, Secrets, PVCs, its ServiceAccount
    and PriorityClass, wherever a pod spec can name them."""
    refs = {("ServiceAccount", pod.spec.get("serviceAccountName", "default"))}
    if "priorityClassName" in pod.spec:
        refs.add(("PriorityClass", pod.spec["priorityClassName"]))
    refs |= volume_references(pod.spec.get("volumes", []))
    for c in pod.containers():
        refs |= container_references(c)
    return refs


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_a_pod_names_exists_in_the_render(overlay: str) -> None:
    """A name kustomize did not rewrite (a generated ConfigMap's hash suffix in a CRD) leaves the pod
    in CreateContainerConfigError forever: nothing fails, so nothing restarts it. Not checked: an
    optional reference (the pod starts without it), kube-root-ca.crt and the default
    ServiceAccount (every namespace has them)."""
    docs = build(overlay)
    cluster_made = {("ConfigMap", "kube-root-ca.crt"), ("ServiceAccount", "default")}  # in every namespace
    present = {(d["kind"], d["metadata"]["name"]) for d in docs} | cluster_made
    for pod in pod_templates(docs):
        missing = references(pod) - present
        assert not missing, f"{overlay}: {pod.owner} references {sorted(missing)}, absent from the render"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_trainer_pod_has_shm_in_memory_and_the_nvme_mount(overlay: str) -> None:
    docs = build(overlay)
    for pod in trainer_pods(docs):
        volumes = {v["name"]: v for v in pod.spec["volumes"]}
        trainer = next(c for c in pod.spec["containers"] if c["name"] == "trainer")
        mounts = {m["mountPath"]: m["name"] for m in trainer["volumeMounts"]}
        shm = volumes[mounts["/dev/shm"]]  # KeyError: NCCL gets the container's 64 MiB /dev/shm
        assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"], pod.owner
        nvme_path = env_of(trainer)["LOCAL_NVME"]
        nvme = volumes[mounts[nvme_path]]
        if overlay == "overlays/cpu-smoke":  # no node directory to make by hand on kind/minikube
            assert nvme["emptyDir"]["sizeLimit"], pod.owner
        else:
            assert nvme["hostPath"]["type"] == "Directory", pod.owner


def quantity_bytes(q: str) -> int:
    """A Kubernetes memory quantity in bytes (the binary suffixes the manifests use)."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    return int(q[:-2]) * units[q[-2:]] if q[-2:] in units else int(q)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_tier0_is_a_memory_volume_at_its_dir_sized_by_pretrain_plan(overlay: str, tmp_path: Path) -> None:
    """checkpoint.memory.dir is an emptyDir {medium: Memory} whose sizeLimit is what `pretrain plan`
    prints for the pod's config at the render's node and rank counts, within the memory limit."""
    docs = build(overlay)
    cm = next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith("pretrain-config"))
    (tmp_path / "config.yaml").write_text(cm["data"]["config.yaml"])
    cfg = load_config(tmp_path / "config.yaml")
    mem = cfg.checkpoint.memory
    assert mem.enabled, f"{overlay}: tier 0 is off"
    nproc = int(env_configmap(docs)["NPROC_PER_NODE"])
    for pod in trainer_pods(docs):
        volumes = {v["name"]: v for v in pod.spec["volumes"]}
        trainer = next(c for c in pod.spec["containers"] if c["name"] == "trainer")
        mounts = {m["mountPath"]: m["name"] for m in trainer["volumeMounts"]}
        tier0 = volumes[mounts[mem.dir]]  # KeyError: tier 0 would fill the container's own layer
        assert tier0["emptyDir"]["medium"] == "Memory", pod.owner
        assert mounts[mem.dir] != mounts["/dev/shm"], "tier 0 apart from NCCL's /dev/shm"
        nodes = int(env_of(trainer)["NNODES"])
        size = model_size(cfg, nodes * nproc)
        plan = plan_memory_tier(
            size.state_bytes_per_rank, nproc, mem.slots, cfg.checkpoint.replication.factor - 1, None, None
        )
        assert tier0["emptyDir"]["sizeLimit"] == plan.size_limit, f"{pod.owner}: fix: set it to {plan.size_limit}"
        shm = volumes[mounts["/dev/shm"]]["emptyDir"]["sizeLimit"]
        limit = quantity_bytes(trainer["resources"]["limits"]["memory"])
        assert limit > quantity_bytes(plan.size_limit) + quantity_bytes(shm), f"{pod.owner}: tmpfs pages count"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_hostpath_creates_its_directory(overlay: str) -> None:
    """DirectoryOrCreate (or no type) on an unmounted instance store writes tier 1 to the root disk."""
    for pod in pod_templates(build(overlay)):
        for v in pod.spec.get("volumes", []):
            if "hostPath" in v:
                assert v["hostPath"].get("type") in ("Directory", "File", "Socket", "CharDevice", "BlockDevice"), (
                    f"{overlay}: {pod.owner} volume {v['name']}: hostPath type {v['hostPath'].get('type')!r} "
                    "may create it; use type: Directory"
                )


def test_h100_statefulset_and_jobset_get_the_same_node_parts() -> None:
    """One component gives both H100 deployments the same node: GPUs, EFA, hugepages, /dev/shm, NVMe, zone."""
    (sts,) = trainer_pods(build("overlays/h100"))
    (js,) = trainer_pods(build("overlays/h100-jobset"))
    for key in ("nodeSelector", "tolerations", "volumes", "terminationGracePeriodSeconds", "securityContext"):
        assert sts.spec[key] == js.spec[key], key
    res = [next(c for c in p.spec["containers"] if c["name"] == "trainer")["resources"] for p in (sts, js)]
    assert res[0] == res[1] and res[0]["limits"]["hugepages-2Mi"] == res[0]["requests"]["hugepages-2Mi"]
    assert res[0]["limits"]["vpc.amazonaws.com/efa"] == "32"
    nvme = next(v for v in sts.spec["volumes"] if v["name"] == "nvme")
    assert nvme["hostPath"]["path"] == "/mnt/k8s-disks/0/pretrain"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_failure_domain_comes_from_the_node_labels(overlay: str) -> None:
    """The node-domain init container reads the pod's Node (RBAC: get nodes, nothing more) and writes
    the topology file the trainer's launcher reads; no pod-label downward API, no zone spread."""
    docs = build(overlay)
    for pod in trainer_pods(docs):
        init = next(c for c in pod.spec["initContainers"] if c["name"] == "node-domain")
        assert init["command"][:2] == ["pretrain", "node-domain"]
        output = init["command"][init["command"].index("--output") + 1]
        trainer = next(c for c in pod.spec["containers"] if c["name"] == "trainer")
        env = env_of(trainer)
        assert env["TOPOLOGY_FILE"] == output and "FAILURE_DOMAIN" not in env
        assert env_of(init)["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
        mount = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}["/run/pretrain"]
        assert {m["mountPath"]: m["name"] for m in trainer["volumeMounts"]}["/run/pretrain"] == mount
        assert "topologySpreadConstraints" not in pod.spec
        sa = pod.spec["serviceAccountName"]
        namespace = next(d for d in docs if d["kind"] == "StatefulSet" or d["kind"] == "JobSet")["metadata"].get(
            "namespace"
        )
        binding = next(
            d for d in by_kind(docs, "ClusterRoleBinding") if d["metadata"]["name"].startswith("pretrain-node-reader-")
        )
        assert {"kind": "ServiceAccount", "name": sa, "namespace": namespace} in binding["subjects"]
        role = next(d for d in by_kind(docs, "ClusterRole") if d["metadata"]["name"] == binding["roleRef"]["name"])
        assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
        assert token_mounted(init) and token_mounted(trainer), "both call the API server"
    label = env_configmap(docs)["FAILURE_DOMAIN_LABEL"]
    chain = "topology.k8s.aws/network-node-layer-3,topology.k8s.aws/network-node-layer-2"  # then the node
    assert label == ("kubernetes.io/hostname" if "cpu" in overlay else chain)


# Node labels that EKS managed node groups, Karpenter and EKS Auto Mode all set on a P5 node.
PROVISIONER_NEUTRAL_LABELS = {"node.kubernetes.io/instance-type", "kubernetes.io/arch", "kubernetes.io/os"}


@pytest.mark.parametrize("overlay", ["overlays/h100", "overlays/h100-jobset"])
def test_efa_pods_select_p5_by_labels_every_provisioner_sets_and_share_one_zone(overlay: str) -> None:
    """A nodegroup or nodepool name in the selector leaves every pod Pending under the other
    provisioner; a zone name means another zone in another account. The pods follow each other
    into one zone instead (EFA does not cross zones)."""
    (pod,) = trainer_pods(build(overlay))
    selector = pod.spec["nodeSelector"]
    assert selector["node.kubernetes.io/instance-type"] == "p5.48xlarge"
    assert set(selector) <= PROVISIONER_NEUTRAL_LABELS, sorted(set(selector) - PROVISIONER_NEUTRAL_LABELS)
    rendered = render(overlay)
    for banned in ("eks.amazonaws.com/nodegroup", "karpenter.sh/nodepool:", "us-east-1a", "use1-az"):
        assert banned not in rendered, banned
    (together,) = pod.spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert together["topologyKey"] == "topology.kubernetes.io/zone"
    assert matches(together["labelSelector"], pod.labels(0)), "the pods must select each other"
    assert "nodeAffinity" not in pod.spec.get("affinity", {}), "one selector, in nodeSelector"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_drains_take_one_trainer_pod_at_a_time_with_its_emergency_save(overlay: str, tmp_path: Path) -> None:
    """An announced interruption (drain, spot, maintenance, node repair) evicts through the API: the
    budget lets one trainer pod go, as SIGTERM with a grace period that covers the emergency save
    (fault_tolerance.emergency_save_timeout + ft_launcher's 10 s), instead of refusing until the
    instance disappears. Karpenter's own consolidation stays off; the PriorityClass queues the
    pods ahead of default work but never preempts another tenant."""
    docs = build(overlay)
    (pdb,) = by_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    priority = {d["metadata"]["name"]: d for d in by_kind(docs, "PriorityClass")}
    cfg = pod_config(docs, tmp_path)
    for pod in trainer_pods(docs):
        assert matches(pdb["spec"]["selector"], pod.labels(0)), pod.owner
        assert pod.metadata["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
        pc = priority[pod.spec["priorityClassName"]]
        assert pc["preemptionPolicy"] == "Never" and 0 < pc["value"] < 1_000_000 and not pc["globalDefault"]
        assert pod.spec["terminationGracePeriodSeconds"] > cfg.fault_tolerance.emergency_save_timeout + 10
    others = [t for t in pod_templates(docs) if t.component != "trainer"]
    assert others and not any(matches(pdb["spec"]["selector"], t.labels(0)) for t in others)
    for sts in by_kind(docs, "StatefulSet"):
        assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}, "no rolling restart of a synchronous job"


def test_jobset_does_not_count_disruptions_against_its_restarts() -> None:
    js = by_kind(build("overlays/h100-jobset"), "JobSet")[0]
    rules = job_of(js)["spec"]["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert js["spec"]["failurePolicy"]["maxRestarts"] >= 100


SECURE_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
# The one root container: it chowns the staging volume's top directories once (CHOWN, nothing else).
STAGING_SETUP = "Job/pretrain-staging-setup"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_drops_privileges_on_a_read_only_root(overlay: str) -> None:
    """Nothing in these pods needs root (docs/runbook.md#identities-and-privileges) but the staging
    setup Job; every container's root filesystem is read-only (writable emptyDirs where needed)."""
    pods = pod_templates(build(overlay))
    assert STAGING_SETUP in {p.owner for p in pods}
    for pod in pods:
        ctx = pod.spec["securityContext"]
        containers = pod.containers()
        if pod.owner == STAGING_SETUP:
            assert ctx["runAsUser"] == 0 and [c["securityContext"]["capabilities"] for c in containers] == [
                {"drop": ["ALL"], "add": ["CHOWN"]}
            ]
        else:
            assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] != 0, pod.owner
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, pod.owner
        for c in containers:
            got = {k: c.get("securityContext", {}).get(k) for k in SECURE_CONTAINER}
            want = dict(SECURE_CONTAINER)
            if pod.owner == STAGING_SETUP:
                want["capabilities"] = {"drop": ["ALL"], "add": ["CHOWN"]}
            assert got == want, f"{overlay}: {pod.owner} container {c['name']}: {got}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_job_has_its_own_identity(overlay: str) -> None:
    """Trainers read, the uploader writes, the GC CronJob deletes: three ServiceAccounts, three roles."""
    docs = build(overlay)
    roles = {
        sa["metadata"]["name"]: sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"]
        for sa in by_kind(docs, "ServiceAccount")
    }
    by_component = {
        t.component: roles[t.spec["serviceAccountName"]] for t in pod_templates(docs) if "serviceAccountName" in t.spec
    }
    assert by_component["trainer"].endswith("-reader")
    assert by_component["uploader"].endswith("-writer")
    assert by_component["gc"].endswith("-gc")
    (gc,) = by_kind(docs, "CronJob")
    assert gc["spec"]["concurrencyPolicy"] == "Forbid"
    command = gc["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["pretrain", "gc"] and "--apply" in command


def granted(docs: list[dict[str, Any]], account: str) -> set[tuple[str, str]]:
    """(resource, verb) pairs the render's (Cluster)RoleBindings grant ServiceAccount ``account``."""
    roles = {(d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"] in ("Role", "ClusterRole")}
    out = set()
    for binding in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if not any(s["kind"] == "ServiceAccount" and s["name"] == account for s in binding["subjects"]):
            continue
        role = roles[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]
        out |= {(res, verb) for rule in role["rules"] for res in rule["resources"] for verb in rule["verbs"]}
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_trainer_may_taint_its_node_and_delete_its_pod_and_nothing_broader(overlay: str) -> None:
    """An excluded straggler's launch (pretrain/commands/node_taint.py) GETs and PATCHes its Node and
    DELETEs its pod; the trainer's account gets exactly that besides reading nodes, and its pods
    carry the Node's name (the taint's target) from the downward API."""
    docs = build(overlay)
    (account,) = {t.spec["serviceAccountName"] for t in trainer_pods(docs)}
    assert granted(docs, account) == {("nodes", "get"), ("nodes", "patch"), ("pods", "delete")}
    for pod in trainer_pods(docs):
        trainer = next(c for c in pod.spec["containers"] if c["name"] == "trainer")
        assert env_of(trainer)["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}, pod.owner
        assert token_mounted(trainer), pod.owner


CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "PriorityClass", "Namespace"} | {
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}


def test_no_two_overlays_share_a_cluster_scoped_object() -> None:
    """Applying (or deleting) the smoke overlay for a drill must not rebind, rename or delete the
    production run's roles, PriorityClass or admission policy. The production overlays are two
    deployments of one run in one namespace (apply one of them), so only their Namespace may match."""
    names = {}
    for overlay in OVERLAYS:
        docs = build(overlay)
        names[overlay] = {(d["kind"], d["metadata"]["name"]) for d in docs if d["kind"] in CLUSTER_SCOPED}
        for d in docs:
            assert (d["kind"] in CLUSTER_SCOPED) == ("namespace" not in d["metadata"]), (overlay, d["kind"])
        assert {k for k, _ in names[overlay]} == CLUSTER_SCOPED, overlay
    for a, b in ((x, y) for i, x in enumerate(OVERLAYS) for y in OVERLAYS[i + 1 :]):
        shared = {kn for kn in names[a] & names[b] if kn[0] != "Namespace"}
        assert not shared, f"{a} and {b} both define {sorted(shared)}"
    smoke_ns = {n for k, n in names["overlays/cpu-smoke"] if k == "Namespace"}
    assert smoke_ns.isdisjoint(n for k, n in names["overlays/h100"] if k == "Namespace")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_overlay_ships_its_namespace_at_the_pod_security_level_hostpath_needs(overlay: str) -> None:
    docs = build(overlay)
    (ns,) = by_kind(docs, "Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert {d["metadata"]["namespace"] for d in docs if "namespace" in d["metadata"]} == {ns["metadata"]["name"]}
    for binding in by_kind(docs, "ClusterRoleBinding"):
        assert {s["namespace"] for s in binding["subjects"]} == {ns["metadata"]["name"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_staging_setup_job_owns_the_trainers_staging_volume_once(overlay: str) -> None:
    docs = build(overlay)
    (setup,) = [t for t in pod_templates(docs) if t.owner == STAGING_SETUP]
    (trainer,) = trainer_pods(docs)
    assert volume_references(setup.spec["volumes"]) & volume_references(trainer.spec["volumes"]) == {
        ("PersistentVolumeClaim", "pretrain-staging")
    }
    script = setup.spec["containers"][0]["args"][0]
    assert "chown 1000:1000" in script and "-R" not in script, "top directories only, never a recursive chown"
    uid = trainer.spec["securityContext"]["runAsUser"]
    assert (uid, trainer.spec["securityContext"]["runAsGroup"]) == (1000, 1000)


def overlay_without(overlay: str, component: str, where: Path) -> list[dict[str, Any]]:
    """The overlay rendered with one of its components left out (in a copy of k8s/)."""
    shutil.copytree(K8S, where / "k8s")
    kfile = where / "k8s" / overlay / "kustomization.yaml"
    line = f"  - ../../components/{component}\n"
    assert line in kfile.read_text()
    kfile.write_text(kfile.read_text().replace(line, ""))
    out = subprocess.run(["kubectl", "kustomize", str(kfile.parent)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize(
    ("overlay", "component"),
    [
        ("overlays/cpu-smoke", "monitoring-statefulset"),
        ("overlays/h100", "monitoring-statefulset"),
        ("overlays/h100-jobset", "monitoring-jobset"),
    ],
)
def test_the_prometheus_operator_objects_are_a_component_an_overlay_can_leave_out(
    overlay: str, component: str, tmp_path: Path
) -> None:
    full = build(overlay)
    without = overlay_without(overlay, component, tmp_path)
    operator = [d for d in full if d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert {d["kind"] for d in operator} == {"PodMonitor", "PrometheusRule"}
    assert not [d for d in without if d["apiVersion"].startswith("monitoring.coreos.com/")]
    dashboard = [d for d in full if d["metadata"]["name"] == "pretrain-grafana-dashboard"]
    ident = {(d["kind"], d["metadata"]["name"]) for d in without}
    assert ident == {(d["kind"], d["metadata"]["name"]) for d in full if d not in operator + dashboard}


def test_the_dashboard_ships_as_a_grafana_sidecar_configmap_equal_to_the_json() -> None:
    source = (REPO / "monitoring" / "grafana-dashboard.json").read_text()
    assert (K8S / "components" / "monitoring" / "grafana-dashboard.json").read_text() == source, (
        "fix: cp monitoring/grafana-dashboard.json k8s/components/monitoring/"
    )
    for overlay in OVERLAYS:
        (cm,) = [d for d in build(overlay) if d["metadata"]["name"] == "pretrain-grafana-dashboard"]
        assert cm["kind"] == "ConfigMap" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["data"]["grafana-dashboard.json"] == source


@pytest.mark.parametrize(
    ("overlay", "source"), [("overlays/cpu-smoke", "configs/ft-cpu.yaml"), ("overlays/h100", "configs/ft-h100.yaml")]
)
def test_the_ft_launcher_config_is_the_configs_file_byte_for_byte(overlay: str, source: str) -> None:
    docs = build(overlay)
    cm = next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith("pretrain-config"))
    assert cm["data"]["ft.yaml"] == (REPO / source).read_text(), f"fix: copy {source} into the overlay's ft.yaml"
    ft = yaml.safe_load(cm["data"]["ft.yaml"])["fault_tolerance"]
    assert set(ft["rank_section_timeouts"]) >= {"setup", "step", "checkpointing"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_init_container_restores_and_the_trainer_mounts_the_configs_reshardable_dir(
    overlay: str, tmp_path: Path
) -> None:
    """The trainer's own restore fetches S3 into checkpoint.reshardable.dir; an init container
    restoring anywhere else (it did: /staging/<run> against /staging/reshardable/<run>) downloads
    the newest step on every pod-0 start into a directory nothing reads or prunes."""
    docs = build(overlay)
    cfg = pod_config(docs, tmp_path)
    for pod in pod_templates(docs):
        for c in pod.containers():
            assert "tiering" not in json.dumps(c.get("command", []) + c.get("args", [])), (pod.owner, c["name"])
    for pod in trainer_pods(docs):
        trainer = next(c for c in pod.spec["containers"] if c["name"] == "trainer")
        staging = {m["mountPath"] for m in trainer["volumeMounts"] if m["name"] == "staging"}
        assert any(cfg.checkpoint.reshardable.dir.startswith(p + "/") for p in staging), pod.owner
        assert env_configmap(docs)["RUN_DIR"] == cfg.run.dir and env_configmap(docs)["RUN_ID"] == cfg.run.id
        assert any(cfg.run.dir.startswith(p + "/") for p in staging), "DONE lives on the shared volume"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_pod_on_a_dead_node_is_released_within_a_minute(overlay: str) -> None:
    for pod in trainer_pods(build(overlay)):
        tolerations = {t["key"]: t for t in pod.spec["tolerations"] if t["key"].startswith("node.kubernetes.io/")}
        assert set(tolerations) == {"node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"}
        for t in tolerations.values():
            assert t["effect"] == "NoExecute" and 0 < t["tolerationSeconds"] <= 60, t


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_fsgroup_never_chowns_a_volume_that_already_has_it(overlay: str) -> None:
    pods = [p for p in pod_templates(build(overlay)) if "fsGroup" in p.spec["securityContext"]]
    assert pods
    for pod in pods:
        assert pod.spec["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch", pod.owner


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_api_tokens_are_mounted_only_where_the_api_is_called(overlay: str) -> None:
    """node-domain reads its Node and the trainer's excluded-node path patches it: they get the
    token; every other container (the uploader and gc use IRSA's own token) gets none."""
    for pod in pod_templates(build(overlay)):
        assert pod.spec["automountServiceAccountToken"] is False, pod.owner
        mounted = {c["name"] for c in pod.containers() if token_mounted(c)}
        assert mounted == ({"node-domain", "trainer"} if pod.component == "trainer" else set()), pod.owner


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_jobs_own_pods_reach_its_ports_and_monitoring_its_metrics(overlay: str) -> None:
    """Security review F1: the rendezvous store, the process-group and gloo ports, replication and
    tier-0 peer traffic accept only the job's trainer pods; the metrics ports only the monitoring
    namespace. A podSelector without a namespaceSelector means this namespace only."""
    docs = build(overlay)
    policies = {
        p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: p
        for p in by_kind(docs, "NetworkPolicy")
    }
    assert set(policies) == {"trainer", "uploader"}
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    for component, policy in policies.items():
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        pods = [t for t in pod_templates(docs) if matches(policy["spec"]["podSelector"], t.labels(0))]
        assert {t.component for t in pods} == {component}
        rules = policy["spec"]["ingress"]
        port = next(
            p["containerPort"]
            for t in pods
            for c in t.spec["containers"]
            for p in c.get("ports", [])
            if p["name"] == "metrics"
        )
        assert {"from": [monitoring], "ports": [{"port": port, "protocol": "TCP"}]} in rules
        peers = [r for r in rules if r["from"] != [monitoring]]
        if component == "uploader":
            assert not peers
            continue
        (peer,) = peers
        assert "ports" not in peer, "gloo and the stores use ephemeral ports: every port, job pods only"
        (source,) = peer["from"]
        assert set(source) == {"podSelector"}, "no namespaceSelector: this namespace only"
        senders = [t for t in pod_templates(docs) if matches(source["podSelector"], t.labels(0))]
        assert [t.owner for t in senders] == [t.owner for t in trainer_pods(docs)]
        assert all(matches(source["podSelector"], t.labels(i)) for t in senders for i in range(2))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_admission_limits_the_trainer_to_its_own_node_and_pod(overlay: str) -> None:
    """Security review F4: RBAC grants patch on every Node; the policy admits a trainer's patch only
    on the node named in its token, adding only the exclusion taint, and a delete only of its own pod."""
    docs = build(overlay)
    policy, binding = admission(docs, "pretrain-trainer-scope")
    spec = policy["spec"]
    rules = {(r["resources"][0], tuple(r["operations"])) for r in spec["matchConstraints"]["resourceRules"]}
    assert rules == {("nodes", ("UPDATE",)), ("pods", ("DELETE",))}
    (account,) = {t.spec["serviceAccountName"] for t in trainer_pods(docs)}
    (cond,) = spec["matchConditions"]
    assert f"endsWith(':{account}')" in cond["expression"]
    variables = {v["name"]: v["expression"] for v in spec["variables"]}
    assert "authentication.kubernetes.io/node-name" in variables["nodeClaim"]
    assert "authentication.kubernetes.io/pod-name" in variables["podClaim"]
    text = [v["expression"] for v in spec["validations"]]
    assert any("object.metadata.name == variables.nodeClaim" in e for e in text)
    assert any("oldObject.metadata.name == variables.podClaim" in e for e in text)
    from pretrain.commands.node_taint import EFFECT, TAINT_KEY

    assert any(f"t.key == '{TAINT_KEY}' && t.effect == '{EFFECT}'" in e for e in text)


def admission(docs: list[dict[str, Any]], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ValidatingAdmissionPolicy named ``prefix``-<overlay> and its binding, which denies."""
    (policy,) = [d for d in by_kind(docs, "ValidatingAdmissionPolicy") if d["metadata"]["name"].startswith(prefix)]
    (binding,) = [
        d
        for d in by_kind(docs, "ValidatingAdmissionPolicyBinding")
        if d["spec"]["policyName"] == policy["metadata"]["name"]
    ]
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    assert policy["spec"]["failurePolicy"] == "Fail"
    return policy, binding


@pytest.mark.parametrize("overlay", ["overlays/h100", "overlays/cpu-smoke"])
def test_the_trainer_statefulsets_pod_template_is_pinned_while_the_job_runs(overlay: str) -> None:
    """Review 19: with OnDelete a pod recreated after a node loss runs the newest applied template;
    the policy admits a template change only while the StatefulSet has no pods (the whole-job
    restart scales it to 0 first), so every pod of a job runs the job's revision."""
    docs = build(overlay)
    policy, _ = admission(docs, "pretrain-template-pin")
    spec = policy["spec"]
    [rule] = spec["matchConstraints"]["resourceRules"]
    assert (rule["apiGroups"], rule["resources"], rule["operations"]) == (["apps"], ["statefulsets"], ["UPDATE"])
    (sts,) = by_kind(docs, "StatefulSet")
    (cond,) = spec["matchConditions"]
    for key, value in sts["metadata"]["labels"].items():
        assert f"object.metadata.labels['{key}'] == '{value}'" in cond["expression"], "it matches this StatefulSet"
    [check] = spec["validations"]
    assert "object.spec.template == oldObject.spec.template" in check["expression"]
    assert "oldObject.status.replicas == 0" in check["expression"] and "fix:" in check["messageExpression"]
    assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
    runbook = (REPO / "docs" / "runbook.md").read_text()
    assert "scale sts pretrain --replicas=0" in runbook, "the whole-job restart the policy asks for"


def test_kueue_admits_the_jobset_as_one_gang(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(K8S / "overlays" / "h100-jobset", tmp_path)],
                "components": [os.path.relpath(K8S / "components" / "kueue", tmp_path)],
            }
        )
    )
    out = subprocess.run(["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    (js,) = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "JobSet"]
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "pretrain"
    plain = by_kind(build("overlays/h100-jobset"), "JobSet")[0]
    assert js["spec"] == plain["spec"]


@pytest.mark.parametrize("overlay", ["overlays/h100", "overlays/h100-jobset"])
def test_gpu_pods_get_the_efa_and_megatron_environment(overlay: str, tmp_path: Path) -> None:
    """NCCL_NET=OFI: a plugin that does not load fails at communicator init instead of training over
    TCP; one CUDA connection with sequence parallelism; the NCCL flight recorder, dumped to the
    node's NVMe (it outlives the pod)."""
    docs = build(overlay)
    env = env_configmap(docs)
    cfg = pod_config(docs, tmp_path)
    assert env["NCCL_NET"] == "OFI" and env["FI_PROVIDER"] == "efa"
    assert cfg.parallel.sequence_parallel and env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0 and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    (pod,) = trainer_pods(docs)
    trainer = next(c for c in pod.spec["containers"] if c["name"] == "trainer")
    nvme = env_of(trainer)["LOCAL_NVME"]
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"].startswith(nvme + "/")


FAKE_PRETRAIN = """#!/bin/sh
echo "$*" >> "$RECORD"
trap 'echo TERM >> "$RECORD"; exit 0' TERM
if [ -n "${FAKE_WAIT:-}" ]; then
    touch "$READY"
    while :; do sleep 0.05; done
fi
exit "${FAKE_EXIT:-0}"
"""


@dataclass
class EntryRun:
    """trainer-entry.sh as the rendered ConfigMap ships it, run here with a stand-in `pretrain`."""

    root: Path

    @property
    def env(self) -> dict[str, str]:
        return {
            "PATH": f"{self.root / 'bin'}:{os.environ['PATH']}",
            "LOCAL_NVME": str(self.root / "nvme"),
            "RUN_ID": "run-1",
            "RUN_DIR": str(self.root / "runs"),
            "CONFIG": str(self.root / "config.yaml"),
            "RECORD": str(self.root / "record"),
            "READY": str(self.root / "ready"),
        }

    def start(self, **extra: str) -> subprocess.Popen[str]:
        script = self.root / "trainer-entry.sh"
        return subprocess.Popen(
            ["/bin/sh", str(script), "--ft-config", "ft.yaml"],
            env={**self.env, **extra},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def run(self, **extra: str) -> tuple[int, str]:
        proc = self.start(**extra)
        out, _ = proc.communicate(timeout=30)
        return proc.returncode, out

    def launches(self) -> list[str]:
        record = self.root / "record"
        return record.read_text().splitlines() if record.exists() else []


@pytest.fixture
def entry(tmp_path: Path) -> EntryRun:
    docs = build("overlays/h100")
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith("pretrain-entry")]
    (tmp_path / "trainer-entry.sh").write_text(cm["data"]["trainer-entry.sh"])
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "pretrain"
    fake.write_text(FAKE_PRETRAIN)
    fake.chmod(0o755)
    (tmp_path / "nvme").mkdir()
    (tmp_path / "config.yaml").write_text("train: {steps: 10}\n")
    return EntryRun(tmp_path)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_trainer_runs_the_entry_script_with_the_launch_arguments(overlay: str) -> None:
    docs = build(overlay)
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith("pretrain-entry")]
    assert cm["data"]["trainer-entry.sh"] == (K8S / "common" / "trainer-entry.sh").read_text()
    for pod in trainer_pods(docs):
        trainer = next(c for c in pod.spec["containers"] if c["name"] == "trainer")
        volumes = {v["name"]: v for v in pod.spec["volumes"]}
        (mount,) = [
            m
            for m in trainer["volumeMounts"]
            if volumes[m["name"]].get("configMap", {}).get("name") == cm["metadata"]["name"]
        ]
        assert trainer["command"] == ["/bin/sh", f"{mount['mountPath']}/trainer-entry.sh"]
        args = trainer["args"]
        assert args[args.index("--ft-config") + 1] == "/etc/pretrain/ft.yaml" and "--config" not in args
        assert args[args.index("--nproc-per-node") + 1] == "$(NPROC_PER_NODE)"
        idle = env_of(trainer).get("IDLE_WHEN_DONE")
        assert idle == ("1" if pod.owner.startswith("StatefulSet/") else None), "StatefulSet pods always restart"


def test_a_finished_run_is_recorded_and_not_trained_again_under_the_same_config(entry: EntryRun) -> None:
    code, _ = entry.run()
    assert code == 0 and entry.launches() == [f"launch --config {entry.root / 'config.yaml'} --ft-config ft.yaml"]
    done = entry.root / "runs" / "run-1" / "DONE"
    assert done.read_text().strip() == hashlib.sha256((entry.root / "config.yaml").read_bytes()).hexdigest()
    code, out = entry.run()
    assert code == 0 and len(entry.launches()) == 1 and "finished under this config" in out
    (entry.root / "config.yaml").write_text("train: {steps: 20}\n")  # more steps: it trains on
    assert entry.run()[0] == 0 and len(entry.launches()) == 2


def test_a_finished_statefulset_pod_idles_instead_of_restarting(entry: EntryRun) -> None:
    assert entry.run()[0] == 0
    proc = entry.start(IDLE_WHEN_DONE="1")
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=1.5)
        assert len(entry.launches()) == 1
        proc.send_signal(signal.SIGTERM)  # deleting the idle pod: it goes at once, its sleep too
        out, _ = proc.communicate(timeout=10)
        assert proc.returncode == 0, out
    finally:
        proc.kill()
        proc.communicate(timeout=10)


@pytest.mark.parametrize("code", [1, 2, 3])
def test_a_failed_launch_passes_its_exit_code_and_records_nothing(entry: EntryRun, code: int) -> None:
    assert entry.run(FAKE_EXIT=str(code))[0] == code
    assert not (entry.root / "runs" / "run-1" / "DONE").exists()


def test_sigterm_reaches_the_launcher_and_a_stopped_pod_never_marks_the_run_done(entry: EntryRun) -> None:
    proc = entry.start(FAKE_WAIT="1")
    try:
        for _ in range(200):
            if (entry.root / "ready").exists():
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert entry.launches()[-1] == "TERM", out
    assert proc.returncode == 0 and not (entry.root / "runs" / "run-1" / "DONE").exists()


def test_the_runs_nvme_directory_is_private_and_a_planted_one_is_refused(entry: EntryRun) -> None:
    assert entry.run(FAKE_EXIT="1")[0] == 1
    private = entry.root / "nvme" / "run-1"
    assert stat.S_IMODE(private.stat().st_mode) == 0o700 and private.stat().st_uid == os.getuid()
    private.chmod(0o755)
    assert entry.run(FAKE_EXIT="1")[0] == 1 and stat.S_IMODE(private.stat().st_mode) == 0o700
    private.rmdir()
    (entry.root / "elsewhere").mkdir()
    private.symlink_to(entry.root / "elsewhere")
    launched = len(entry.launches())
    code, out = entry.run()
    assert code == 3 and "is a symlink" in out and "fix:" in out and len(entry.launches()) == launched


AWS = K8S / "aws"
AWS_VALUES = {
    "ACCOUNT_ID": "123456789012",
    "REGION": "us-east-1",
    "BUCKET": "my-training-bucket",
    "PREFIX": "checkpoints",
    "RUN_ID": "gpt-8b-run-001",
    "NAMESPACE": "pretrain",
    "KMS_KEY_ID": "1234abcd-12ab-34cd-56ef-1234567890ab",
    "OIDC_PROVIDER": "oidc.eks.us-east-1.amazonaws.com/id/EXAMPLED539D4633E53DE1B71EXAMPLE",
}


def fill_aws(out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/bin/sh", str(AWS / "fill.sh"), str(out)],
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_one_command_fills_every_aws_policy_for_the_run(tmp_path: Path) -> None:
    """Trust policies name the overlay's ServiceAccounts in its namespace; the bucket lets only the
    Gc role delete and no run role destroy a version, keeps noncurrent versions 30 days
    (docs/runbook.md), and takes only the run's KMS key."""
    done = fill_aws(tmp_path, **AWS_VALUES)
    assert done.returncode == 0, done.stderr
    filled = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert set(filled) == {p.name for p in AWS.glob("*.json")} | {"iam-policy.json"}
    text = "\n".join(p.read_text() for p in tmp_path.glob("*.json"))
    for name in AWS_VALUES:
        assert name not in text, name
    docs = build("overlays/h100")
    roles = {
        sa["metadata"]["name"]: sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].replace(
            "ACCOUNT_ID", AWS_VALUES["ACCOUNT_ID"]
        )
        for sa in by_kind(docs, "ServiceAccount")
    }
    namespace = by_kind(docs, "Namespace")[0]["metadata"]["name"]
    for role, account in (("reader", "pretrain-trainer"), ("writer", "pretrain-uploader"), ("gc", "pretrain-gc")):
        (st,) = filled[f"trust-{role}.json"]["Statement"]
        cond = st["Condition"]["StringEquals"]
        assert cond[f"{AWS_VALUES['OIDC_PROVIDER']}:sub"] == f"system:serviceaccount:{namespace}:{account}"
        assert cond[f"{AWS_VALUES['OIDC_PROVIDER']}:aud"] == "sts.amazonaws.com"
        assert roles[account].endswith(f"-{role}")
    bucket = {st["Sid"]: st for st in filled["bucket-policy.json"]["Statement"]}
    assert {st["Effect"] for st in bucket.values()} == {"Deny"}, "grants live in the roles' policies"
    assert bucket["OnlyGcDeletesSteps"]["Condition"] == {"ArnNotEquals": {"aws:PrincipalArn": roles["pretrain-gc"]}}
    never = bucket["NoRunRoleDestroysAVersion"]
    assert "s3:DeleteObjectVersion" in never["Action"] and "s3:PutBucketVersioning" in never["Action"]
    run_roles = never["Condition"]["ArnLike"]["aws:PrincipalArn"]
    assert all(fnmatch.fnmatch(arn, run_roles) for arn in roles.values())
    key = f"arn:aws:kms:us-east-1:{AWS_VALUES['ACCOUNT_ID']}:key/{AWS_VALUES['KMS_KEY_ID']}"
    (rule,) = filled["encryption.json"]["Rules"]
    assert rule["ApplyServerSideEncryptionByDefault"] == {"SSEAlgorithm": "aws:kms", "KMSMasterKeyID": key}
    assert bucket["RunKeyOnly"]["Condition"]["StringNotEqualsIfExists"].popitem()[1] == key
    assert filled["versioning.json"] == {"Status": "Enabled"}
    (life,) = filled["lifecycle.json"]["Rules"]
    assert life["NoncurrentVersionExpiration"]["NoncurrentDays"] == 30
    assert "30 days" in (REPO / "docs" / "runbook.md").read_text()
    writer = {a for st in filled["kms-policy.json"]["Writer"]["Statement"] for a in st["Action"]}
    assert writer == {"kms:GenerateDataKey", "kms:Decrypt"}


def test_the_aws_fill_refuses_a_missing_value_in_one_line(tmp_path: Path) -> None:
    values = {k: v for k, v in AWS_VALUES.items() if k != "KMS_KEY_ID"}
    done = fill_aws(tmp_path / "out", **values)
    assert done.returncode == 2 and not (tmp_path / "out").exists()
    (line,) = done.stderr.splitlines()
    assert "KMS_KEY_ID is not set" in line and "fix:" in line


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_read_only_trainer_writes_its_caches_and_temporary_files_to_an_emptydir(overlay: str) -> None:
    """ft_launcher's --help cache (XDG_CACHE_HOME), NVRx's sockets (TMPDIR), compiler caches (HOME)."""
    for pod in trainer_pods(build(overlay)):
        volumes = {v["name"]: v for v in pod.spec["volumes"]}
        trainer = next(c for c in pod.spec["containers"] if c["name"] == "trainer")
        mounts = {m["mountPath"]: m["name"] for m in trainer["volumeMounts"]}
        assert "emptyDir" in volumes[mounts["/tmp"]] and volumes[mounts["/tmp"]]["emptyDir"].get("medium") != "Memory"
        env = env_of(trainer)
        for name in ("HOME", "TMPDIR", "XDG_CACHE_HOME"):
            assert env[name] == "/tmp" or env[name].startswith("/tmp/"), (pod.owner, name)

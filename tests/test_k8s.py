"""The Kubernetes deployment: every overlay built with kustomize and validated offline against the
Kubernetes OpenAPI schemas in strict mode; the JobSet against its CRD's schema; cross-object
consistency (replicas = NNODES, grace period > emergency save, configs that load, every name a pod
references exists in the render); what a trainer pod needs from its node (/dev/shm in memory, the
NVMe mount, no hostPath that creates its directory, tier 0 in a memory volume sized by `pretrain
plan`); failure domains from node labels; lifecycle
(OnDelete, PDB, priority, disruptions not counted); one identity per job and a securityContext on
every container; the IAM policy."""

from __future__ import annotations

import copy
import functools
import json
import shutil
import subprocess
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
        if d["kind"] in ("StatefulSet", "Deployment"):
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
    roles = {
        sa["metadata"]["name"]: sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"]
        for sa in by_kind(docs, "ServiceAccount")
    }
    assert roles[pod["serviceAccountName"]].endswith("-reader") and roles[up_pod["serviceAccountName"]].endswith(
        "-writer"
    )


def test_jobset_restarts_the_whole_group_and_stops_on_config_errors() -> None:
    docs = build("overlays/h100-jobset")
    js = by_kind(docs, "JobSet")[0]
    policy = js["spec"]["failurePolicy"]
    assert policy["maxRestarts"] > 0 and policy["restartStrategy"] == "Recreate"
    job = job_of(js)["spec"]
    assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"
    fail_job = next(r for r in job["podFailurePolicy"]["rules"] if r["action"] == "FailJob")
    assert fail_job["onExitCodes"]["values"] == [2]
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
            if key in src
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
    in CreateContainerConfigError forever: nothing fails, so nothing restarts it."""
    docs = build(overlay)
    present = {(d["kind"], d["metadata"]["name"]) for d in docs}
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
            d for d in by_kind(docs, "ClusterRoleBinding") if d["metadata"]["name"] == "pretrain-node-reader"
        )
        assert {"kind": "ServiceAccount", "name": sa, "namespace": namespace} in binding["subjects"]
        role = next(d for d in by_kind(docs, "ClusterRole") if d["metadata"]["name"] == binding["roleRef"]["name"])
        assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    label = env_configmap(docs)["FAILURE_DOMAIN_LABEL"]
    assert label == ("kubernetes.io/hostname" if "cpu" in overlay else "topology.k8s.aws/network-node-layer-3")


@pytest.mark.parametrize("overlay", ["overlays/h100", "overlays/h100-jobset"])
def test_efa_pods_are_pinned_to_one_zone_and_placement_group(overlay: str) -> None:
    (pod,) = trainer_pods(build(overlay))
    selector = pod.spec["nodeSelector"]
    assert selector["topology.kubernetes.io/zone"] and selector["eks.amazonaws.com/nodegroup"]
    assert "nodeAffinity" not in pod.spec.get("affinity", {}), "one pin, in nodeSelector"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_voluntary_disruptions_cannot_take_a_trainer_pod(overlay: str) -> None:
    docs = build(overlay)
    (pdb,) = by_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 0
    priority = {d["metadata"]["name"]: d for d in by_kind(docs, "PriorityClass")}
    for pod in trainer_pods(docs):
        assert matches(pdb["spec"]["selector"], pod.labels(0)), pod.owner
        assert pod.metadata["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
        assert priority[pod.spec["priorityClassName"]]["value"] >= 1_000_000
    others = [t for t in pod_templates(docs) if t.component != "trainer"]
    assert others and not any(matches(pdb["spec"]["selector"], t.labels(0)) for t in others)
    for sts in by_kind(docs, "StatefulSet"):
        assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}, "no rolling restart of a synchronous job"


def test_jobset_does_not_count_disruptions_against_its_restarts() -> None:
    js = by_kind(build("overlays/h100-jobset"), "JobSet")[0]
    rules = job_of(js)["spec"]["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert js["spec"]["failurePolicy"]["maxRestarts"] >= 100


SECURE_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_drops_privileges(overlay: str) -> None:
    """Nothing in these pods needs root (docs/runbook.md#identities-and-privileges)."""
    for pod in pod_templates(build(overlay)):
        ctx = pod.spec["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] != 0, pod.owner
        for c in pod.containers():
            got = {k: c.get("securityContext", {}).get(k) for k in SECURE_CONTAINER}
            assert got == SECURE_CONTAINER, f"{overlay}: {pod.owner} container {c['name']}: {got}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_job_has_its_own_identity(overlay: str) -> None:
    """Trainers read, the uploader writes, the GC CronJob deletes: three ServiceAccounts, three roles."""
    docs = build(overlay)
    roles = {
        sa["metadata"]["name"]: sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"]
        for sa in by_kind(docs, "ServiceAccount")
    }
    by_component = {t.component: roles[t.spec["serviceAccountName"]] for t in pod_templates(docs)}
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
        assert pod.spec.get("automountServiceAccountToken", True), pod.owner

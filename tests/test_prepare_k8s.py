"""k8s/prepare-data: the Indexed Job and the merge Job, built with kustomize and validated offline
against the Kubernetes OpenAPI schemas in strict mode (as tests/test_k8s.py does for the trainer);
shard count consistency; and the pods' own shell commands run here, per index, with the ConfigMap's
environment: the shards they write merge to the one-machine dataset."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pretrain.config import load_config
from pretrain.data.prepare import prepare_data
from tests.helpers import REPO
from tests.prepare_corpus import write_corpus

K8S = REPO / "k8s" / "prepare-data"
K8S_VERSION = "1.33.0"


def build(path: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (for `kubectl kustomize`) is not installed"
    out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, [d["kind"] for d in docs]
    return found[0]


@pytest.mark.parametrize("path", [K8S, K8S / "merge"])
def test_every_manifest_validates_strictly(path: Path) -> None:
    for doc in build(path):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_strict_validation_rejects_a_misspelt_job_field() -> None:
    job = copy.deepcopy(one(build(K8S), "Job"))
    job["spec"]["backoffLimitPerIndexx"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def test_the_indexed_job_runs_one_pod_per_shard_and_never_retries_bad_input() -> None:
    docs = build(K8S)
    job, env = one(docs, "Job"), one(docs, "ConfigMap")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(env["data"]["SHARDS"])
    assert spec["maxFailedIndexes"] == 0 and spec["backoffLimitPerIndex"] >= 1
    rules = spec["podFailurePolicy"]["rules"]
    assert {
        "action": "FailIndex",
        "onExitCodes": {"containerName": "prepare", "operator": "In", "values": [2]},
    } in rules
    for d in (job, one(build(K8S / "merge"), "Job")):
        container = d["spec"]["template"]["spec"]["containers"][0]
        assert container["envFrom"][0]["configMapRef"]["name"] == env["metadata"]["name"]


def test_prepared_data_lands_where_the_h100_trainer_reads_it_with_its_tokenizer(tmp_path: Path) -> None:
    """The same volume (the run's RWX staging claim, which the trainer mounts at the same path, in
    the same namespace), the merged prefix = data.prefix, the tokenizer = data.tokenizer_path, the
    trainer's image digest, and the trainer's non-root securityContext."""
    from tests.test_k8s import build as build_overlay
    from tests.test_k8s import trainer_pods

    trainer_docs = build_overlay("overlays/h100")
    (trainer,) = trainer_pods(trainer_docs)
    trainer_mounts = {
        m["name"]: m["mountPath"]
        for c in trainer.spec["containers"]
        if c["name"] == "trainer"
        for m in c["volumeMounts"]
    }
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in trainer.spec["volumes"]
        if "persistentVolumeClaim" in v
    }
    (pvc,) = [d for d in trainer_docs if d["kind"] == "PersistentVolumeClaim"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and pvc["spec"]["storageClassName"]
    cm = next(
        d for d in trainer_docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("pretrain-config")
    )
    (tmp_path / "config.yaml").write_text(cm["data"]["config.yaml"])
    cfg = load_config(tmp_path / "config.yaml")
    (sts,) = [d for d in trainer_docs if d["kind"] == "StatefulSet"]
    trainer_image = next(c["image"] for c in trainer.spec["containers"] if c["name"] == "trainer")
    env = one(build(K8S), "ConfigMap")["data"]
    assert env["MERGED"] == cfg.data.prefix
    assert env["TOKENIZER_ARGS"].split() == [
        "--tokenizer",
        cfg.data.tokenizer,
        "--tokenizer-path",
        cfg.data.tokenizer_path,
    ]
    for path in (K8S, K8S / "merge"):
        (job,) = [d for d in build(path) if d["kind"] == "Job"]
        assert job["metadata"]["namespace"] == sts["metadata"]["namespace"]
        pod = job["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["image"] == trainer_image
        assert pod["securityContext"]["runAsUser"] == trainer.spec["securityContext"]["runAsUser"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        (name,) = [v["name"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
        claim = next(v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if v["name"] == name)
        trainer_name = next(n for n, c in claims.items() if c == claim)
        assert mounts[name] == trainer_mounts[trainer_name], "one path on both sides"
        assert env["MERGED"].startswith(mounts[name] + "/") and env["OUTPUT"].startswith(mounts[name] + "/")


def _script(job: dict[str, Any]) -> str:
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["/bin/sh", "-c"]
    return container["args"][0]


@pytest.mark.slow
def test_the_pods_commands_prepare_shards_that_merge_to_the_one_machine_dataset(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    write_corpus(corpus)
    prep, merge = one(build(K8S), "Job"), one(build(K8S / "merge"), "Job")
    config = one(build(K8S), "ConfigMap")["data"]
    env = {
        **os.environ,
        **config,
        "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "PYTHONWARNINGS": "ignore",
        # the volume's paths, here; the rest (PREPARE_ARGS, WORKERS) as the ConfigMap says
        "INPUT": f"{corpus}/*.jsonl* {corpus}/d.parquet",
        "OUTPUT": str(tmp_path / "prepared" / "shards" / "web"),
        "MERGED": str(tmp_path / "prepared" / "web"),
        "SHARDS": "2",
        "WORKERS": "1",
        "TOKENIZER_ARGS": "--tokenizer byte",
    }
    pods = [
        subprocess.Popen(["/bin/sh", "-c", _script(prep)], env={**env, "JOB_COMPLETION_INDEX": str(i)})
        for i in range(2)
    ]
    try:
        assert [p.wait(timeout=300) for p in pods] == [0, 0]
    finally:
        for p in pods:
            p.kill()
    assert subprocess.run(["/bin/sh", "-c", _script(merge)], env=env, timeout=300).returncode == 0
    args = config["PREPARE_ARGS"].split()
    assert args == ["--json-key", "text", "--dedup", "--min-chars", "200"], "update the one-machine run below"
    prepare_data(
        tmp_path / "one", [f"{corpus}/*.jsonl*", corpus / "d.parquet"], dedup=True, min_chars=200, progress=False
    )
    for suffix in (".bin", ".idx"):
        assert (tmp_path / "prepared" / f"web{suffix}").read_bytes() == (tmp_path / f"one{suffix}").read_bytes()

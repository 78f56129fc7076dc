"""The image the deployments run: the Dockerfile (checked statically: no Docker daemon here) is
built on NVIDIA's PyTorch container pinned by tag, installs the project with its GPU extra and the
megatron-core/NVRx releases the GPU check runs, downloads nothing at run time, and proves at build
time exactly the entry points the Kubernetes manifests and the Slurm script call; every overlay
records the digest it deploys (IMAGE_DIGEST) and Slurm derives it from its container image."""

from __future__ import annotations

import re
from typing import Any

import pytest
import tomllib

from tests.helpers import REPO
from tests.test_k8s import OVERLAYS, build, env_configmap

DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, argument) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def build_args() -> dict[str, str]:
    return dict(a.split("=", 1) for k, a in instructions() if k == "ARG" and "=" in a)


def run_commands() -> str:
    return " && ".join(a for k, a in instructions() if k == "RUN")


def pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] == "JobSet":
        return [rj["template"]["spec"]["template"]["spec"] for rj in doc["spec"]["replicatedJobs"]]
    if doc["kind"] in ("StatefulSet", "Deployment"):
        return [doc["spec"]["template"]["spec"]]
    return []


ENTRY_SCRIPT = REPO / "k8s" / "common" / "trainer-entry.sh"


def programs(container: dict[str, Any]) -> list[str]:
    """The programs a container runs: its command, what its shell script execs, or what the
    trainer's entry script (k8s/common/trainer-entry.sh) starts."""
    cmd = list(container.get("command", [])) + list(container.get("args", []))
    if cmd[:2] == ["/bin/sh", "-c"]:
        return re.findall(r"\bexec\s+([\w./-]+)", " ".join(cmd[2:]))
    if cmd[:1] == ["/bin/sh"] and cmd[1].endswith("/" + ENTRY_SCRIPT.name):
        return re.findall(r"^(pretrain) launch ", ENTRY_SCRIPT.read_text(), re.MULTILINE)
    return cmd[:1]


def project_image_containers(overlay: str) -> list[dict[str, Any]]:
    out = []
    for doc in build(overlay):
        for spec in pod_specs(doc):
            out += [
                c for c in spec.get("initContainers", []) + spec["containers"] if "resilient-pretrain" in c["image"]
            ]
    return out


def test_base_is_nvidias_pytorch_container_pinned_by_tag() -> None:
    froms = [a for k, a in instructions() if k == "FROM"]
    assert froms == ["${BASE_IMAGE}"]
    base = build_args()["BASE_IMAGE"]
    m = re.fullmatch(r"nvcr\.io/nvidia/pytorch:(\d\d\.\d\d)-py3(@sha256:[0-9a-f]{64})?", base)
    assert m, f"BASE_IMAGE {base!r} is not NVIDIA's PyTorch container pinned by a release tag"


def test_installs_the_gpu_extra_and_the_checked_releases_at_build_time() -> None:
    run = run_commands()
    assert re.search(r"pip install .*\"\.\[gpu\]\"", run)
    args = build_args()
    assert args["MEGATRON_CORE_SPEC"].strip('"') == "megatron-core>=0.19,<0.20"
    assert args["NVRX_SPEC"].strip('"') == "nvidia-resiliency-ext>=0.7,<0.8"
    assert '"${MEGATRON_CORE_SPEC}"' in run and '"${NVRX_SPEC}"' in run
    gpu_extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert any(d.startswith("transformer-engine") for d in gpu_extra)
    copied = {a.split()[0] for k, a in instructions() if k == "COPY"}
    assert {"pretrain", "tiering", "pyproject.toml"} <= copied
    # Nothing is fetched when a container starts: CMD/ENTRYPOINT run an installed program only.
    for k, a in instructions():
        if k in ("CMD", "ENTRYPOINT"):
            assert not re.search(r"pip|curl|wget|git ", a), a


def proven_entry_points() -> set[str]:
    """The programs the build runs with --help (it fails if one is missing)."""
    return set(re.findall(r"(?:^|&&)\s*([\w-]+) --help", run_commands()))


def test_the_entry_points_the_image_proves_are_the_ones_the_manifests_call() -> None:
    called: set[str] = set()
    for overlay in OVERLAYS:
        for container in project_image_containers(overlay):
            called |= set(programs(container))
    sbatch = (REPO / "slurm" / "pretrain.sbatch").read_text()
    assert re.search(r'"\$PRETRAIN" launch', sbatch) and "PRETRAIN=${PRETRAIN:-pretrain}" in sbatch
    called.add("pretrain")
    launch = (REPO / "pretrain" / "commands" / "launch.py").read_text()
    assert 'shutil.which("ft_launcher")' in launch  # pretrain launch execs NVRx's ft_launcher
    called.add("ft_launcher")
    assert called == {"pretrain", "ft_launcher"}
    # tiering: the runbook's manual restore and `tiering ls` run in the image too.
    assert proven_entry_points() == called | {"tiering"}
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert proven_entry_points() - {"ft_launcher"} == set(scripts)
    for target in scripts.values():
        module, _, func = target.partition(":")
        assert callable(getattr(__import__(module, fromlist=[func]), func))


def _digest(image: str) -> str:
    return image.rsplit("@", 1)[1] if "@" in image else "unknown"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_records_the_digest_it_deploys(overlay: str) -> None:
    containers = project_image_containers(overlay)
    images = {c["image"] for c in containers}
    assert len(images) == 1, images  # trainer, its init containers and the uploader run one image
    recorded = env_configmap(build(overlay))["IMAGE_DIGEST"]
    assert recorded == _digest(images.pop())
    assert re.fullmatch(r"sha256:[0-9a-f]{64}|unknown", recorded)
    trainers = [c for c in containers if c["name"] == "trainer"]  # the ranks write the manifests
    assert trainers
    for c in trainers:
        assert any(e.get("configMapRef", {}).get("name", "").startswith("pretrain-env") for e in c.get("envFrom", []))


def test_slurm_runs_the_image_through_pyxis_and_records_its_digest() -> None:
    sbatch = (REPO / "slurm" / "pretrain.sbatch").read_text()
    assert '--container-image="$CONTAINER_IMAGE"' in sbatch and "--container-mounts=" in sbatch
    assert '"${container[@]}"' in sbatch.split("srun --ntasks-per-node=1", 1)[1].splitlines()[0]
    assert "IMAGE_DIGEST=${IMAGE_DIGEST:-sha256:${CONTAINER_IMAGE##*@sha256:}}" in sbatch
    assert "export IMAGE_DIGEST=${IMAGE_DIGEST:-unknown}" in sbatch


def test_the_image_installs_the_efa_userspace_and_the_nccl_plugin_it_proves_loads() -> None:
    """Without the aws-ofi-nccl plugin (or with one that cannot resolve its libraries) NCCL trains
    over TCP sockets silently; the build installs the EFA userspace (no kernel module) and the
    plugin built against it, pinned, puts both on the loader path and fails if the plugin has an
    unresolved library."""
    args = build_args()
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["EFA_INSTALLER_VERSION"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["AWS_OFI_NCCL_VERSION"])
    run = run_commands()
    assert "efa_installer.sh -y -g -d --skip-kmod --skip-limit-conf --no-verify" in run
    assert "--with-libfabric=/opt/amazon/efa" in run and "--with-cuda=" in run and "--enable-platform-aws" in run
    assert "apt-get remove -y --allow-change-held-packages ibverbs-utils libibverbs-dev libibverbs1" in run
    assert "plugin=/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so" in run and 'test -f "$plugin"' in run
    assert '! ldd "$plugin" | grep "not found"' in run and "fi_info --version" in run
    env = " ".join(a for k, a in instructions() if k == "ENV")
    assert re.search(r"LD_LIBRARY_PATH=/opt/amazon/efa/lib:/opt/amazon/ofi-nccl/lib:", env)
    assert "efa_installer" in next(a for k, a in instructions() if k == "RUN"), "EFA first, then pip"


@pytest.mark.parametrize("overlay", ["overlays/h100", "overlays/h100-jobset"])
def test_efa_deployments_make_nccl_fail_without_the_plugin(overlay: str) -> None:
    env = env_configmap(build(overlay))
    assert env["NCCL_NET"] == "OFI" and env["FI_PROVIDER"] == "efa"
    plugin = next(a for k, a in instructions() if k == "RUN" and "plugin=" in a).split("plugin=")[1].split()[0]
    assert plugin.endswith(f"/libnccl-net-{env['NCCL_NET_PLUGIN']}.so"), "NCCL loads the plugin the image built"

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pretrain.data.prepare import build_indexed_dataset, synthetic_documents
from pretrain.data.train_tokenizer import train_bpe_tokenizer
from tests.helpers import REFERENCE_40, overrides_for, torchrun
from tests.leftovers import session_env
from tests.suite_cache import built_once

pytest_plugins = ["tests.leftover_guard"]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1 MB synthetic corpus as a Megatron indexed dataset (prefix path)."""
    prefix = tmp_path_factory.mktemp("data") / "corpus"
    build_indexed_dataset(synthetic_documents(1.0, seed=0), prefix)
    return prefix


# The uninterrupted 2-rank run of the tiny config to step 40 (``REFERENCE_40``, tests/helpers.py; its
# cosine decay over those 40 steps) that the 40-step fault tests compare their losses and grad norms
# with, step by step. Where and how often a run checkpoints does not change what a step computes
# (those tests save at intervals of 5, 10 and 20 and each compares with this run bit for bit), so one
# run per test run serves them all instead of one baseline job per test (its corpus is another
# worker's when that worker built it: the same bytes, from the same seed).
@pytest.fixture(scope="session")
def reference_40(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """The run directory of the shared 40-step reference run (``REFERENCE_40``), run on first use."""

    def run(base: Path) -> None:
        torchrun(base, 2, overrides_for(base, corpus, **REFERENCE_40))

    return built_once(tmp_path_factory, "reference-40", run) / "runs" / "t"


@pytest.fixture(scope="session")
def hf_corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two BPE tokenizers of one size trained on different text, and two datasets made with the first."""
    d = tmp_path_factory.mktemp("hf")
    text_a, text_b = d / "a.txt", d / "b.txt"
    text_a.write_text("\n\n".join(synthetic_documents(0.3, seed=21)))
    text_b.write_text("\n\n".join(synthetic_documents(0.3, seed=22)).upper())
    train_bpe_tokenizer([text_a], 400, d / "tok-a.json")
    train_bpe_tokenizer([text_b], 400, d / "tok-b.json")
    for name, seed, mb in (("web", 31, 0.3), ("code", 32, 0.2)):
        hf = {"tokenizer": "huggingface", "tokenizer_path": str(d / "tok-a.json")}
        build_indexed_dataset(synthetic_documents(mb, seed=seed), d / name, **hf)
    return {"web": d / "web", "code": d / "code", "tok_a": d / "tok-a.json", "tok_b": d / "tok-b.json"}


# Distinctive, so that tests can prove it never lands in a manifest or a log.
RGW_SECRET = "rp-secret-7c41e2b9d0"


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """A real S3 server for the session: ``S3_ENDPOINT_URL`` (+ AWS_* credentials) if given, else a
    single-node Ceph RADOS Gateway started on 127.0.0.1 (installed by ``make test``)."""
    import shutil
    import subprocess
    import tempfile

    from tests.helpers import REPO, free_port

    if os.environ.get("S3_ENDPOINT_URL"):
        yield os.environ["S3_ENDPOINT_URL"]
        return
    if not shutil.which("radosgw"):
        pytest.skip("no S3 server: install radosgw (scripts/install-system-deps.sh) or set S3_ENDPOINT_URL")
    for _attempt in range(3):  # a start can fail transiently (e.g. a port taken meanwhile): retry fresh
        state = tempfile.mkdtemp(prefix="rgw-", dir="/tmp")
        env = {
            **session_env(),
            "STATE_DIR": state,
            "RGW_PORT": str(free_port()),
            "MON_PORT": str(free_port()),
            "RGW_SECRET_KEY": RGW_SECRET,
        }
        proc = subprocess.run(
            [str(REPO / "scripts" / "ceph" / "start-rgw.sh")], env=env, capture_output=True, text=True, timeout=240
        )
        if proc.returncode == 0:
            break
        logs = subprocess.run(f"tail -n 3 {state}/log/*.log", shell=True, capture_output=True, text=True).stdout
        subprocess.run([str(REPO / "scripts" / "ceph" / "stop-rgw.sh")], env=env, timeout=60)
    else:
        pytest.fail(f"could not start Ceph RGW: {proc.stdout[-500:]} {proc.stderr[-1500:]} {logs[-1500:]}")
    endpoint = proc.stdout.strip().splitlines()[-1].split("=", 1)[1]
    os.environ["AWS_ACCESS_KEY_ID"] = "testing"
    os.environ["AWS_SECRET_ACCESS_KEY"] = RGW_SECRET
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ["RP_TEST_RGW_CONF"] = f"{state}/ceph.conf"  # radosgw-admin for tests that add users
    try:
        yield endpoint
    finally:
        subprocess.run([str(REPO / "scripts" / "ceph" / "stop-rgw.sh")], env=env, timeout=60)


@pytest.fixture
def shm_root() -> Iterator[Path]:
    """A tier-0 root on the machine's tmpfs, removed afterwards."""
    root = Path("/dev/shm") / f"rp-test-{uuid.uuid4().hex[:12]}"
    root.mkdir()
    try:
        yield root
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)


@pytest.fixture
def bucket(s3_endpoint: str) -> str:
    import boto3

    name = f"t-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def slurm_cluster():  # noqa: ANN201
    """A real one-node Slurm cluster (slurmctld + slurmd + munge) for the session; yields the
    environment (``SLURM_CONF``) that sbatch/scontrol need. Installed by ``make test``."""
    import shutil
    import subprocess
    import tempfile

    from tests.helpers import REPO, free_port

    if not (shutil.which("slurmctld") and shutil.which("sbatch") and shutil.which("munged")):
        pytest.skip("no Slurm: install slurmctld slurmd slurm-client munge (scripts/install-system-deps.sh)")
    if os.geteuid() != 0:
        pytest.skip("the test Slurm cluster runs its daemons as root")
    state = tempfile.mkdtemp(prefix="slurm-", dir="/tmp")
    ports = {name: str(free_port()) for name in ("CTLD_PORT", "SLURMD_PORT", "SPARE_PORT")}
    env = {**session_env(), "STATE": state, **ports}
    proc = subprocess.run(
        [str(REPO / "scripts" / "slurm" / "start.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0:
        subprocess.run([str(REPO / "scripts" / "slurm" / "stop.sh")], env=env, timeout=60)
        pytest.fail(f"could not start Slurm: {proc.stdout[-800:]} {proc.stderr[-1500:]}")
    env["SLURM_CONF"] = f"{state}/slurm.conf"
    try:
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True, timeout=30)
        subprocess.run([str(REPO / "scripts" / "slurm" / "stop.sh")], env=env, timeout=60)


@pytest.fixture(params=["rgw", "file"])
def remote_uri(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str | None]:
    """The object-store tier twice: a real Ceph RGW bucket, and the file:// emulation."""
    if request.param == "file":
        return f"file://{tmp_path / 'objects'}", None
    endpoint = request.getfixturevalue("s3_endpoint")
    return f"s3://{request.getfixturevalue('bucket')}/ckpt", endpoint


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The machine the durations above were measured on: they mean little without it."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    terminalreporter.line(f"machine: {os.cpu_count()} CPUs, load average {load} at the end of the run")


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """This test's tier-0 root on the machine's tmpfs (never the shared default), removed after."""
    root = Path("/dev/shm") / f"rp-test-{uuid.uuid4().hex[:12]}"
    try:
        yield root
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)

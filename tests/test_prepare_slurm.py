"""slurm/prepare-data.sbatch on a real one-node Slurm cluster: a 4-task array job prepares four
shards, merge-data joins them, and the result equals the one-machine dataset byte for byte; the
array submitted again skips every finished shard."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from pretrain.data.prepare import merge_data, prepare_data
from tests.helpers import REPO, job_env
from tests.prepare_corpus import write_corpus

pytestmark = pytest.mark.slow


def _array_done(job: str, env: dict[str, str], deadline_s: float) -> None:
    """Wait until no task of the array is in the queue (squeue lists pending and running ones)."""
    deadline = time.monotonic() + deadline_s
    while True:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%i %T"], capture_output=True, text=True, env=env)
        if out.returncode == 0 and not out.stdout.strip():
            return
        assert time.monotonic() < deadline, f"array {job} still queued: {out.stdout}"
        time.sleep(0.5)


def _submit(tmp_path: Path, env: dict[str, str]) -> str:
    submit = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--array=0-3",
            f"--output={tmp_path}/prep-%A_%a.out",
            str(REPO / "slurm/prepare-data.sbatch"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert submit.returncode == 0, submit.stderr
    return submit.stdout.strip().split(";")[0]


def test_a_4_way_array_job_merges_to_the_one_machine_dataset(tmp_path: Path, slurm_cluster: dict[str, str]) -> None:
    corpus = tmp_path / "corpus"
    write_corpus(corpus)
    shards = tmp_path / "prep" / "web"
    env = {
        **job_env(tmp_path),
        "SLURM_CONF": slurm_cluster["SLURM_CONF"],
        "INPUT": f"{corpus}/*.jsonl* {corpus}/d.parquet {corpus}/e.txt",
        "OUTPUT": str(shards),
        "PREPARE_ARGS": "--dedup --min-chars 20",
        "PRETRAIN": str(REPO / ".venv" / "bin" / "pretrain"),
        "PYTHONPATH": str(REPO),
    }
    job = _submit(tmp_path, env)
    _array_done(job, env, 300)
    logs = {p.name: p.read_text() for p in sorted(tmp_path.glob(f"prep-{job}_*.out"))}
    assert len(logs) == 4, logs
    for i in range(4):
        text = logs[f"prep-{job}_{i}.out"]
        assert f"shard {i}/4" in text and f"wrote {shards}.shard-{i:05d}-of-00004.bin/.idx" in text, text[-2000:]

    merged = merge_data(shards, tmp_path / "merged")
    one = prepare_data(
        tmp_path / "one",
        [f"{corpus}/*.jsonl*", corpus / "d.parquet", corpus / "e.txt"],
        dedup=True,
        min_chars=20,
        progress=False,
    )
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"merged{suffix}").read_bytes() == (tmp_path / f"one{suffix}").read_bytes()
    assert (merged["documents"], merged["tokens"], merged["dropped"]) == (
        one["documents"],
        one["tokens"],
        one["dropped"],
    )

    # The same array again (a resubmission, or every task requeued): nothing is prepared twice.
    stamps = {p: p.stat().st_mtime_ns for p in shards.parent.iterdir()}
    again = _submit(tmp_path, env)
    _array_done(again, env, 300)
    for i in range(4):
        text = (tmp_path / f"prep-{again}_{i}.out").read_text()
        assert re.search(rf"already done, not redone: {re.escape(str(shards))}\.shard-{i:05d}-of-00004", text), text
    assert {p: p.stat().st_mtime_ns for p in shards.parent.iterdir()} == stamps

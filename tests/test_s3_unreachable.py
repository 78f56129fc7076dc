"""An object store that cannot be asked never reads as "no checkpoints" (deployment review 13).

A real dead endpoint (a closed port on 127.0.0.1, with credentials, so the failure is the
connection) and a real empty store (the ``file://`` store, the same protocol with no server): only
the store that answered and listed nothing allows the run to start from step 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import events, free_port, overrides_for, torchrun
from tiering.remote.objectstore import open_store
from tiering.remote.run import RemoteRun


def _dead_endpoint() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused


def _fake_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def test_a_dead_endpoint_is_not_an_empty_listing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_credentials(monkeypatch)
    endpoint = _dead_endpoint()
    store, prefix = open_store("s3://bucket/runs", endpoint, connect_timeout_s=1, read_timeout_s=1, max_attempts=1)
    steps, why = RemoteRun(store, prefix, "r").committed_or_unlisted()
    assert steps == [] and why is not None and "\n" not in why
    assert (
        f"s3://bucket at {endpoint}/runs/r/steps (not listed:" in why and "fix: check checkpoint.s3.endpoint_url" in why
    )

    empty, prefix = open_store(f"file://{tmp_path / 'store'}/runs")
    assert RemoteRun(empty, prefix, "r").committed_or_unlisted() == ([], None), "answered, nothing there"


@pytest.mark.slow
def test_a_run_whose_s3_cannot_be_listed_refuses_to_start_from_step_0(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer on a rebuilt cluster (no local or reshardable steps) with a broken S3 route:
    refused in one line naming the endpoint; with an empty store it starts from step 0."""
    _fake_credentials(monkeypatch)
    endpoint = _dead_endpoint()
    common = {"train.steps": 20, "checkpoint.local.interval": 10, "checkpoint.s3.connect_timeout_s": 1}
    dead = {**common, "checkpoint.s3.uri": "s3://bucket/runs", "checkpoint.s3.endpoint_url": endpoint}
    proc = torchrun(tmp_path / "dead", 2, overrides_for(tmp_path / "dead", corpus, **dead), check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    lines = [x for x in text.splitlines() if "FreshStartRefused:" in x and "failed" in x]
    assert lines, text[-3000:]
    assert f"s3://bucket at {endpoint}/runs/t/steps (not listed:" in lines[0], lines[0]
    assert "why: S3 unreachable" in lines[0] and "EndpointConnectionError" in lines[0]
    assert "checkpoint.allow_fresh_start=true" in lines[0]
    assert "fresh_start" not in [e["event"] for e in events(tmp_path / "dead" / "runs" / "t")]

    empty = {**common, "checkpoint.s3.uri": f"file://{tmp_path / 'store'}/runs"}
    torchrun(tmp_path / "empty", 2, overrides_for(tmp_path / "empty", corpus, **empty))
    assert [e["event"] for e in events(tmp_path / "empty" / "runs" / "t")].count("fresh_start") == 1

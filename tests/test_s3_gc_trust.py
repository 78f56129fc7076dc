"""What S3 GC and the init-path restore trust (issue 44 part 6): a step whose objects were overwritten
short or deleted after commit, or a newer step planted without the run key's signature, never
counts as kept, so it cannot push the restorable steps out of ``keep``; the suspect list the trainer
writes (``suspect-steps.json``) is honoured by ``tiering gc --suspects`` and ``tiering restore
--suspects``: a poisoned step is never restored by the init path nor counted as kept. Real objects
in the file:// store and a real Ceph RGW bucket; the commands run as processes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import PYTHON
from tests.test_s3_tier import RUN, _remote, make_step, run_key_file  # noqa: F401 (the key fixture: autouse)
from tiering.layout import RunLayout
from tiering.remote import gc as remote_gc
from tiering.remote.objectstore import open_store
from tiering.remote.tier import RemoteTier


def _uploaded(remote: RemoteTier, staging: Path, steps: tuple[int, ...]) -> None:
    remote.acquire_lease("me")
    for step in steps:
        remote.upload_step(make_step(staging, step, size=1000))


@pytest.mark.parametrize("fault", ["object overwritten short", "object deleted", "newer steps without signature"])
def test_gc_never_counts_a_step_that_cannot_be_restored(
    remote_uri: tuple[str, str | None], tmp_path: Path, fault: str
) -> None:
    remote = _remote(*remote_uri)
    _uploaded(remote, tmp_path / "staging", (10, 20, 30, 40))
    if fault == "newer steps without signature":
        store, prefix = open_store(*remote_uri)
        rogue = RemoteTier(store, prefix, RUN)  # bucket write access, no run key
        for step in (50, 60):
            rogue.upload_step(make_step(tmp_path / "rogue", step, size=1000))
            store.delete([rogue.step_key(step, "SIGNATURE")])
        bad, good = (60, 50), (40, 30, 20)  # 40 and 30 are the run's: 10 is beyond keep, as it should be
    else:
        for step in (40, 30):
            key = remote.step_key(step, "model/__0_0.distcp")
            if fault == "object deleted":
                remote.store.delete([key])
            else:
                remote.store.put_bytes(key, b"short")
        bad, good = (40, 30), (20, 10)
    for _ in range(2):  # mark, then delete what stayed marked
        plan = remote_gc.gc(remote, keep=2, milestone_every=0, dry_run=False, min_age_s=0)
    assert set(good) <= set(plan.keep) and not set(good) & set(plan.deleted), plan
    assert set(remote.committed_steps()) >= {*good, *bad}, "no step kept as restorable was deleted"
    back, rejected = remote.restore_newest(RunLayout(tmp_path / "b", RUN), "r")
    assert back == good[0] and [s for s, _ in rejected] == list(bad), rejected


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "tiering", *args], capture_output=True, text=True, timeout=120)


def test_the_suspect_list_is_honoured_by_tiering_gc_and_tiering_restore(tmp_path: Path) -> None:
    uri = f"file://{tmp_path / 'objects'}"
    remote = _remote(uri, None)
    _uploaded(remote, tmp_path / "staging", (10, 20, 30, 40))
    suspects = tmp_path / "suspect-steps.json"
    suspects.write_text(json.dumps([40, 30]))  # as the trainer writes it: poisoned, they restored to NaN
    for _ in range(2):
        gc = _cli("gc", uri, "--run-id", RUN, "--keep", "2", "--min-age-s", "0", "--apply", "--suspects", str(suspects))
        assert gc.returncode == 0, gc.stderr
    assert "deleted []" in gc.stdout and set(remote.committed_steps()) == {10, 20, 30, 40}, gc.stdout
    restored = _cli("restore", uri, "--run-id", RUN, "--to", str(tmp_path / "back"), "--suspects", str(suspects))
    assert restored.returncode == 0 and "restored step 20" in restored.stdout, restored.stdout + restored.stderr
    assert "rejected step 40: marked suspect" in restored.stdout
    assert sorted(p.name for p in (tmp_path / "back" / RUN / "steps").iterdir()) == ["step-000000020"]
    again = _cli("restore", uri, "--run-id", RUN, "--to", str(tmp_path / "back"), "--suspects", str(suspects))
    assert again.returncode == 0 and "local step 20" in again.stdout, again.stdout + again.stderr
    suspects.write_text("not json")
    broken = _cli("restore", uri, "--run-id", RUN, "--to", str(tmp_path / "x"), "--suspects", str(suspects))
    assert broken.returncode == 2 and broken.stderr.count("\n") == 1, broken.stderr
    assert f"{suspects}: unreadable suspect list" in broken.stderr and "fix:" in broken.stderr

"""The run key file: created private (0600, O_EXCL) when absent and allowed, the same key for every
process that creates it at once, refused with one line and the fix when others may read it, when
it is a symlink or too short; tags verify only under the same key and the same channel."""

from __future__ import annotations

import multiprocessing as mp
import os
import stat
from pathlib import Path

import pytest

from tiering.errors import RunKeyError
from tiering.trust.run_key import ENV_VAR, RunKey, key_file_from_env, load, load_or_create


def _create_and_read(path: str, out: str) -> None:
    Path(out).write_bytes(load_or_create(Path(path)).tag(b"probe"))


def test_a_missing_key_is_created_private_and_every_concurrent_creator_gets_the_same(tmp_path: Path) -> None:
    path = tmp_path / "run" / "run.key"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_create_and_read, args=(str(path), str(tmp_path / f"tag-{i}"))) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4
    tags = {(tmp_path / f"tag-{i}").read_bytes() for i in range(4)}
    assert len(tags) == 1 and tags == {load(path).tag(b"probe")}, "one key for every creator"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_size == 32
    assert sorted(p.name for p in path.parent.iterdir()) == ["run.key"], "no temporary file left"


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_a_key_file_others_can_read_is_refused_with_the_fix(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "run.key"
    path.write_bytes(os.urandom(32))
    path.chmod(mode)
    with pytest.raises(RunKeyError) as err:
        load_or_create(path)
    assert f"mode {mode:04o}" in str(err.value) and f"fix: chmod 600 {path}" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_symlinked_short_or_missing_key_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real.key"
    real.write_bytes(os.urandom(32))
    real.chmod(0o600)
    link = tmp_path / "link.key"
    link.symlink_to(real)
    with pytest.raises(RunKeyError, match="symlink"):
        load_or_create(link)
    short = tmp_path / "short.key"
    short.write_bytes(b"x" * 8)
    short.chmod(0o600)
    with pytest.raises(RunKeyError, match="8 bytes, a run key needs 32"):
        load(short)
    with pytest.raises(RunKeyError, match="no such run key file; fix"):
        load_or_create(tmp_path / "absent.key", create=False)
    assert not (tmp_path / "absent.key").exists()


def test_tags_verify_only_under_the_same_key_and_channel() -> None:
    key = RunKey(b"k" * 32)
    tag = key.for_channel("transport").tag(b"header")
    assert key.for_channel("transport").verify(b"header", tag)
    assert not key.for_channel("transport").verify(b"headex", tag)
    assert not key.for_channel("manifest").verify(b"header", tag), "a tag of one channel fails on another"
    assert not RunKey(b"j" * 32).for_channel("transport").verify(b"header", tag)
    assert "k" * 32 not in repr(key)


def test_the_environment_names_the_key_file(tmp_path: Path) -> None:
    assert key_file_from_env({ENV_VAR: str(tmp_path / "a.key")}) == tmp_path / "a.key"
    assert key_file_from_env({}) is None

"""The run key: a per-run secret that every channel between the run's processes is keyed with.

Owns the secret's file (its mode, owner and creation) and the two operations every channel needs:
:meth:`RunKey.tag` (HMAC-SHA256 over bytes) and :meth:`RunKey.verify` (``hmac.compare_digest``).

The contract for every channel that uses it (the step transport between ranks, tier 0's peer
slots, the signed manifests of the reshardable and S3 tiers, and any later node-to-node channel):

* A channel derives its own key with :meth:`RunKey.for_channel` (``"transport"``, ``"manifest"``,
  ...), so that a tag made for one channel never verifies on another.
* The sender tags every byte the receiver will act on *before* acting on anything else: the
  header (what to receive, where, how large) and the digests of the payload. A payload whose
  digests are covered by a verified tag is authenticated by those digests (so the digest must be
  one the tier refuses to let an attacker choose; tiering enforces that per tier).
* The receiver verifies the tag before it parses, allocates or writes anything the tag covers. A
  tag that does not verify costs one log line and an error result; nothing it covers is written,
  committed or loaded, and the receiver keeps working.
* The tag proves "made by a holder of this run's key". It does not prove freshness: a channel that
  must refuse a replayed message binds what makes it unique (run id, step, owner, destination)
  into the tagged bytes and checks those against its own expectations.

The secret comes from a file (at least 32 bytes; mode 0600, owned by this user, not a symlink: a
file others can read is refused with one line and the fix), named by the caller or by the
environment variable ``PRETRAIN_RUN_KEY_FILE``. :func:`load_or_create` creates it when absent and
creation is allowed: 32 random bytes into a private temporary file (``O_EXCL|O_NOFOLLOW``, 0600)
that is then hard-linked to the name, so concurrent creators agree on one key and no reader sees
a partial file.

Never: logs, prints or stores the secret anywhere else; decides where a run keeps its key (the
caller does: ``checkpoint.integrity.run_key_file`` in the rank program); imports ``pretrain``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from tiering.errors import RunKeyError

ENV_VAR = "PRETRAIN_RUN_KEY_FILE"
SECRET_BYTES = 32  # what a created key holds, and the least a key file may hold
MAX_FILE_BYTES = 4096  # a key file larger than this is not a key file
TAG_BYTES = hashlib.sha256().digest_size  # 32


class RunKey:
    """A run's secret; every tag is HMAC-SHA256 under it."""

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes) -> None:
        if len(secret) < SECRET_BYTES:
            raise RunKeyError(f"a run key must hold at least {SECRET_BYTES} bytes, got {len(secret)}")
        self._secret = bytes(secret)

    def __repr__(self) -> str:
        return "RunKey(<secret>)"  # never the secret

    @classmethod
    def generate(cls) -> RunKey:
        """A fresh random key held in memory only (one process: tests, single-process tools)."""
        return cls(secrets.token_bytes(SECRET_BYTES))

    def for_channel(self, name: str) -> RunKey:
        """The key of one channel, derived from this one: a tag made for another channel never
        verifies on this one."""
        return RunKey(hmac.new(self._secret, b"channel\0" + name.encode("utf-8"), hashlib.sha256).digest())

    def tag(self, data: bytes) -> bytes:
        """HMAC-SHA256 of ``data`` (``TAG_BYTES`` bytes)."""
        return hmac.new(self._secret, data, hashlib.sha256).digest()

    def verify(self, data: bytes, tag: bytes) -> bool:
        """Whether ``tag`` is this key's tag of ``data`` (constant time)."""
        return hmac.compare_digest(self.tag(data), bytes(tag))


def key_file_from_env(env: Mapping[str, str] | None = None) -> Path | None:
    """The key file ``PRETRAIN_RUN_KEY_FILE`` names, or None."""
    value = (os.environ if env is None else env).get(ENV_VAR, "").strip()
    return Path(value) if value else None


def load(path: Path) -> RunKey:
    """The key in ``path``; refuses a symlink, a file of another user, one that group or others may
    read or write, and one too short (RunKeyError: one line with the fix)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise RunKeyError(f"{path}: no such run key file; fix: create it (32+ random bytes, mode 0600)") from exc
    except OSError as exc:
        if os.path.islink(path):
            raise RunKeyError(f"{path}: the run key file is a symlink; fix: name the real file") from exc
        raise RunKeyError(f"{path}: cannot open the run key file ({exc.strerror}); fix: check its path") from exc
    try:
        st = os.fstat(fd)
        _check_private(path, st)
        data = os.read(fd, MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise RunKeyError(f"{path}: over {MAX_FILE_BYTES} bytes, not a run key file; fix: name the key file")
    if len(data) < SECRET_BYTES:
        raise RunKeyError(f"{path}: {len(data)} bytes, a run key needs {SECRET_BYTES}; fix: regenerate it")
    return RunKey(data)


def load_or_create(path: Path, create: bool = True) -> RunKey:
    """The key in ``path``; when absent and ``create``, a new random one written there first
    (mode 0600; concurrent creators end up with the same key)."""
    if create and not os.path.lexists(path):
        _create(path)
    return load(path)


def _check_private(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise RunKeyError(f"{path}: not a regular file; fix: name the run key file")
    if st.st_uid != os.getuid():
        raise RunKeyError(f"{path}: owned by uid {st.st_uid}, not {os.getuid()}; fix: use a key file of your own")
    if st.st_mode & 0o077:
        mode = stat.S_IMODE(st.st_mode)
        raise RunKeyError(f"{path}: mode {mode:04o} lets others read the run key; fix: chmod 600 {path}")


def _create(path: Path) -> None:
    """32 random bytes into a private temporary file, then linked to ``path`` (EEXIST: another
    creator won; its key is the run's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, secrets.token_bytes(SECRET_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)

"""Signed manifests: a step of the reshardable (staging) tier and of the object store carries
``SIGNATURE`` beside ``manifest.json``, an HMAC-SHA256 over the manifest's exact bytes under the
run key's ``"manifest"`` channel (:mod:`tiering.trust.run_key` is the contract).

The manifest holds the run id, the step and every file's size and chunk digests (blake3 in these
tiers: :data:`tiering.digest.PORTABLE_HASH`, enforced on read), so a signature that verifies
authenticates every byte of the step once its digests match. A writer of the shared staging volume
or of the bucket without the run key cannot make a step that a reader holding the key accepts: it
can neither sign a forged manifest nor reuse a signature, which covers one manifest's bytes only.

* Written at publish (:func:`tiering.local.publish.publish_dir`, before ``COMMITTED`` and the rename),
  uploaded beside the manifest (:mod:`tiering.remote.upload`) and fetched with it
  (:mod:`tiering.remote.download`).
* Checked by :func:`tiering.verify.read_manifest` before anything else is read or hashed, and so
  before the restore unpickles or loads anything: a missing or forged signature is a
  :class:`tiering.errors.VerificationError` (one line naming the file and the fix), and the restore
  goes on to the next older step.

Never: signs anything but a manifest's bytes, holds the secret itself (only the derived channel
key), or accepts a step without a signature when the reader was given a key.
"""

from __future__ import annotations

from pathlib import Path

from tiering.errors import VerificationError
from tiering.trust.run_key import RunKey

SIGNATURE_NAME = "SIGNATURE"
CHANNEL = "manifest"
_PREFIX = b"hmac-sha256:"
MAX_BYTES = 256  # a SIGNATURE file larger than this is not one
FIX = (
    "fix: this step was not signed with this run's key (written by a holder of another key, or forged); "
    "the next older signed step is used; point PRETRAIN_RUN_KEY_FILE or checkpoint.integrity.run_key_file "
    "at the run's key if it is the wrong one"
)


class ManifestSigner:
    """Signs and checks manifests with the run key's ``"manifest"`` channel."""

    __slots__ = ("_key",)

    def __init__(self, key: RunKey) -> None:
        self._key = key.for_channel(CHANNEL)

    def __repr__(self) -> str:
        return "ManifestSigner(<key>)"

    def sign(self, manifest_raw: bytes) -> bytes:
        """The ``SIGNATURE`` content for these manifest bytes."""
        return _PREFIX + self._key.tag(manifest_raw).hex().encode() + b"\n"

    def check(self, manifest_raw: bytes, signature: bytes | None, where: Path | str) -> None:
        """Raise VerificationError naming ``where`` (the SIGNATURE file or object) unless
        ``signature`` is this key's signature of ``manifest_raw`` (None: missing)."""
        if signature is None:
            raise VerificationError(where, "SIGNATURE is missing", FIX)
        body = signature.strip()
        if len(signature) > MAX_BYTES or not body.startswith(_PREFIX):
            raise VerificationError(where, "SIGNATURE is not an hmac-sha256 signature", FIX)
        try:
            tag = bytes.fromhex(body[len(_PREFIX) :].decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            raise VerificationError(where, "SIGNATURE is not an hmac-sha256 signature", FIX) from None
        if not self._key.verify(manifest_raw, tag):
            raise VerificationError(where, "SIGNATURE does not verify against manifest.json", FIX)


def read_signature(step_dir: Path) -> bytes | None:
    """The ``SIGNATURE`` file of ``step_dir`` (None when missing; a symlink counts as missing)."""
    path = Path(step_dir) / SIGNATURE_NAME
    if path.is_symlink() or not path.is_file():
        return None
    with open(path, "rb") as fh:
        return fh.read(MAX_BYTES + 1)

"""Where a run's objects live in an object store: its keys, their printable URLs and one listing.

Keys under ``<prefix>/<run id>/``::

    run.json                               the run lease (:mod:`tiering.remote.lease`)
    steps/step-000000123/<file>            immutable objects: chunk digests in our manifest (the hash it
                                           names: BLAKE3 for promoted steps; v1: one SHA-256), the whole
                                           digest tagged with its hash in the object's metadata
    steps/step-000000123/SIGNATURE         the manifest's HMAC under the run key (:mod:`tiering.trust.signature`)
    steps/step-000000123/manifest.json     uploaded after every object's size was checked
    steps/step-000000123/COMMITTED         last, bound to the manifest's SHA-256
    latest.json                            a hint, replaced with If-Match so two writers cannot both win
    gc/marks.json                          steps marked for deletion by an earlier GC pass

Object stores have no rename: a step exists for readers only once ``COMMITTED`` does, and a reader
verifies every byte against the manifest before using it.

:class:`RemoteRun` is what the four protocols (lease, upload and ``latest``, verified download,
GC; one module each) share. It reads only listings and never writes an object. Callers use
:class:`tiering.remote.tier.RemoteTier`, which is a ``RemoteRun`` with the protocols' entry points.
"""

from __future__ import annotations

from tiering.errors import ObjectStoreError
from tiering.layout import parse_step_name, step_name
from tiering.manifest import COMMITTED_NAME
from tiering.remote.objectstore import ObjectStore
from tiering.trust.signature import ManifestSigner


class RemoteRun:
    """The run ``run_id`` under ``prefix`` of ``store``; ``download_concurrency``: parallel GETs of a restore.

    ``signer``: the run's steps are signed (:mod:`tiering.trust.signature`): the upload carries
    ``SIGNATURE`` and refuses a local step without a good one, the download and GC refuse a step
    whose ``SIGNATURE`` is missing or forged. ``expect_hash``: the one digest the run's manifests
    may use (the reshardable tier's, blake3); a manifest naming another is refused before any GET of
    its data. None for either: not checked (tools and tests that hold no key).
    """

    def __init__(
        self,
        store: ObjectStore,
        prefix: str,
        run_id: str,
        download_concurrency: int = 8,
        *,
        signer: ManifestSigner | None = None,
        expect_hash: str | None = None,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.base = "/".join(p for p in (prefix.strip("/"), run_id) if p)
        self.download_concurrency = download_concurrency
        self.signer = signer
        self.expect_hash = expect_hash

    def key(self, *parts: str) -> str:
        return "/".join((self.base, *parts))

    def step_key(self, step: int, rel: str = "") -> str:
        return self.key("steps", step_name(step), rel) if rel else self.key("steps", step_name(step))

    def where(self, key: str) -> str:
        return f"{self.store.url}/{key}"

    def steps(self) -> dict[int, set[str]]:
        """step -> relative object names present (any state), from one listing."""
        out: dict[int, set[str]] = {}
        prefix = self.key("steps") + "/"
        for obj in self.store.list(prefix):
            rest = obj.key[len(prefix) :]
            name, _, rel = rest.partition("/")
            step = parse_step_name(name)
            if step is not None and rel:
                out.setdefault(step, set()).add(rel)
        return out

    def committed_steps(self) -> list[int]:
        return sorted((s for s, names in self.steps().items() if COMMITTED_NAME in names), reverse=True)

    def committed_or_unlisted(self) -> tuple[list[int], str | None]:
        """``(committed steps, None)`` when the store answered the listing (an empty answer too);
        ``([], one line)`` when it could not be listed (endpoint, network, credentials, bucket,
        permissions): then nothing is known about the run's steps, and the caller must not take it
        for "no checkpoints" (a rebuilt cluster with a broken identity would restart from step 0)."""
        try:
            return self.committed_steps(), None
        except ObjectStoreError as exc:
            return [], (
                f"{self.where(self.key('steps'))} (not listed: {str(exc).split('; fix:')[0]}; fix: check "
                "checkpoint.s3.endpoint_url, the network route and the identity's credentials)"
            )

"""Tier 3: verified steps in an object store (S3, or ``file://`` with the same protocol).

:class:`RemoteTier` is the one object callers hold: a :class:`tiering.remote.run.RemoteRun` (the
run's keys and listing; the key layout is documented there) with the entry points of the four
protocols, each in its own module:

* the run lease: :mod:`tiering.remote.lease`
* upload and the ``latest.json`` hint: :mod:`tiering.remote.upload`
* verified download and restore of the newest verified step: :mod:`tiering.remote.download`
* garbage collection: :mod:`tiering.remote.gc`

This module holds no protocol logic of its own: it opens the store and delegates.
"""

from __future__ import annotations

from pathlib import Path

from tiering.collective import Collective
from tiering.layout import RunLayout
from tiering.manifest import Manifest
from tiering.remote import download as remote_download
from tiering.remote import gc as remote_gc
from tiering.remote import lease as remote_lease
from tiering.remote import upload as remote_upload
from tiering.remote.gc import GcPlan
from tiering.remote.objectstore import open_store
from tiering.remote.run import RemoteRun
from tiering.remote.store_faults import install_s3_faults
from tiering.remote.upload import UploadResult
from tiering.trust.signature import ManifestSigner

__all__ = ["RemoteTier"]


class RemoteTier(RemoteRun):
    name = "s3"

    @classmethod
    def open(
        cls,
        uri: str,
        run_id: str,
        *,
        endpoint_url: str | None = None,
        concurrency: int = 8,
        multipart_chunk_mb: int = 64,
        checksum_header: bool = False,
        fault: str | None = None,
        max_attempts: int = 5,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
        signer: ManifestSigner | None = None,
        expect_hash: str | None = None,
    ) -> RemoteTier:
        """The run ``run_id`` under ``uri`` (``s3://bucket/prefix`` or ``file:///path``); ``fault``
        injects deliberate S3 faults (tests and drills only); ``max_attempts``: the S3 client's tries
        per request before the error reaches the caller (whose own backoff then applies), each
        failing after ``connect_timeout_s`` without a connection or ``read_timeout_s`` without an answer;
        ``signer``/``expect_hash``: see :class:`tiering.remote.run.RemoteRun`."""
        store, prefix = open_store(
            uri, endpoint_url, concurrency, multipart_chunk_mb, checksum_header, connect_timeout_s, read_timeout_s,
            max_attempts,
        )  # fmt: skip
        if fault:
            install_s3_faults(store, fault)
        return cls(store, prefix, run_id, concurrency, signer=signer, expect_hash=expect_hash)

    def acquire_lease(self, identity: str) -> None:
        remote_lease.acquire_lease(self, identity)

    def upload_step(self, step_dir: Path) -> UploadResult:
        return remote_upload.upload_step(self, step_dir)

    def update_latest(self, step: int, attempts: int = 5) -> None:
        remote_upload.update_latest(self, step, attempts)

    def latest_hint(self) -> int | None:
        return remote_upload.latest_hint(self)

    def read_manifest(self, step: int) -> tuple[Manifest, bytes]:
        return remote_download.read_remote_manifest(self, step)

    def download_step(self, step: int, layout: RunLayout, attempt: str, coll: Collective | None = None) -> Path:
        """``coll``: every rank of it fetches a share (collective); none: this process alone."""
        return remote_download.download_step(self, step, layout, attempt, coll)

    def restore_newest(
        self,
        layout: RunLayout,
        attempt: str,
        exclude: set[int] | frozenset[int] = frozenset(),
        coll: Collective | None = None,
    ) -> tuple[int | None, list[tuple[int, str]]]:
        """``coll``: every rank of it fetches a share of each step tried (collective); none: this process alone."""
        return remote_download.restore_newest(self, layout, attempt, exclude, coll)

    def gc(
        self,
        keep: int,
        milestone_every: int,
        dry_run: bool = True,
        min_age_s: float = remote_gc.MIN_AGE_S,
        suspects: frozenset[int] = frozenset(),
    ) -> GcPlan:
        """Mark beyond retention; delete what an earlier pass marked at least ``min_age_s`` ago;
        ``suspects`` never count as verified."""
        return remote_gc.gc(self, keep, milestone_every, dry_run, min_age_s=min_age_s, suspects=suspects)

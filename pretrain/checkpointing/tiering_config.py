"""The checkpoint tiers of a pretrain config as ``tiering`` objects: ``pretrain upload`` and ``pretrain gc``.

``tiering`` reads no training config (every setting is a flag there); this adapter maps
``run.id``, ``checkpoint.reshardable`` and ``checkpoint.s3`` onto :func:`tiering.commands.object_store.upload` and
:func:`tiering.commands.object_store.gc`, so the uploader and GC run from the same YAML as the trainer. Both use the
trainer's run key (:mod:`pretrain.checkpointing.run_key_source`: the uploader promotes only steps
whose ``SIGNATURE`` verifies, GC counts only those) and GC the run's ``suspect-steps.json``.
"""

from __future__ import annotations

from pathlib import Path

from pretrain.checkpointing.run_key_source import key_path
from pretrain.config import Config, IntegrityConfig, ReshardableTierConfig, RunConfig, S3TierConfig, s3_owner
from pretrain.errors import ConfigError
from pretrain.observability.runlog import run_dir
from tiering.commands import object_store
from tiering.digest import PORTABLE_HASH
from tiering.local.posix import PosixTier
from tiering.remote.tier import RemoteTier
from tiering.trust.run_key import load_or_create
from tiering.trust.signature import ManifestSigner

SUSPECTS_NAME = "suspect-steps.json"  # written by the trainer (TieredCheckpointer.quarantine_everywhere)


def manifest_signer(integrity: IntegrityConfig, run: RunConfig, create: bool = True) -> ManifestSigner:
    """The run key's manifest signer (the trainer's key file; with ``create``, the default one is
    created if absent, as rank 0 would: concurrent creators agree on one key). RunKeyError: one
    line with the fix."""
    path, may_create = key_path(integrity, run)
    return ManifestSigner(load_or_create(path, create=create and may_create))


def suspects_path(run: RunConfig) -> Path:
    """The run's list of poisoned steps (never restored, never counted as verified by GC)."""
    return run_dir(run.dir, run.id) / SUSPECTS_NAME


def remote_tier(
    s3: S3TierConfig, run_id: str, s3_fault: str | None, source: str, signer: ManifestSigner | None = None
) -> RemoteTier:
    """The run's object store tier (``source``: the config file, for the error; ``s3_fault``:
    ``fault_tolerance.inject.s3_fault``); ConfigError if ``checkpoint.s3.uri`` is not set."""
    if not s3.uri:
        raise ConfigError(f"{source}: checkpoint.s3.uri is not set; fix: set it to s3://bucket/prefix or file:///path")
    return RemoteTier.open(
        s3.uri,
        run_id,
        endpoint_url=s3.endpoint_url,
        concurrency=s3.concurrency,
        multipart_chunk_mb=s3.multipart_chunk_mb,
        checksum_header=s3.checksum_header,
        fault=s3_fault,
        max_attempts=s3.max_attempts,
        connect_timeout_s=s3.connect_timeout_s,
        read_timeout_s=s3.read_timeout_s,
        signer=signer,
        expect_hash=PORTABLE_HASH,
    )


def staging_tier(tier: ReshardableTierConfig, run_id: str, signer: ManifestSigner | None = None) -> PosixTier:
    """The reshardable tier the uploader promotes from."""
    return PosixTier(tier.dir, run_id, tier.keep, name="reshardable", expect_hash=PORTABLE_HASH, signer=signer)


def run_upload(
    cfg: Config, *, watch: bool = False, max_seconds: float | None = None, metrics_port: int | None = None
) -> int:
    """``tiering upload`` with the store, run, owner, polling and backoff of ``cfg``."""
    s3 = cfg.checkpoint.s3
    # a config error first, before any key file is looked for
    remote = remote_tier(s3, cfg.run.id, cfg.fault_tolerance.inject.s3_fault, cfg.source)
    signer = manifest_signer(cfg.checkpoint.integrity, cfg.run)
    remote.signer = signer
    return object_store.upload(
        remote,
        staging_tier(cfg.checkpoint.reshardable, cfg.run.id, signer),
        s3_owner(cfg),
        watch=watch,
        poll_s=s3.poll_s,
        retry_max_s=s3.retry_max_s,
        max_seconds=max_seconds,
        metrics_port=metrics_port,
    )


def run_gc(cfg: Config, *, apply: bool = False) -> int:
    """``tiering gc`` with ``checkpoint.s3.keep`` and ``checkpoint.s3.milestone_every``, the run
    key and the run's suspect list."""
    s3 = cfg.checkpoint.s3
    # a config error first, before any key file is looked for
    remote = remote_tier(s3, cfg.run.id, cfg.fault_tolerance.inject.s3_fault, cfg.source)
    remote.signer = manifest_signer(cfg.checkpoint.integrity, cfg.run, create=False)  # GC never makes up a key
    return object_store.gc(
        remote,
        s3.keep,
        s3.milestone_every,
        apply=apply,
        min_age_s=s3.gc_min_age_s,
        suspects=object_store.read_suspects(suspects_path(cfg.run)),
    )

"""The checkpoint tiers of a pretrain config as ``tiering`` objects: ``pretrain upload`` and ``pretrain gc``.

``tiering`` reads no training config (every setting is a flag there); this adapter maps
``run.id``, ``checkpoint.reshardable`` and ``checkpoint.s3`` onto :func:`tiering.cli.upload` and
:func:`tiering.cli.gc`, so the uploader and GC run from the same YAML as the trainer.
"""

from __future__ import annotations

from pretrain.config import Config, s3_owner
from pretrain.errors import ConfigError
from tiering import cli as tiering_cli
from tiering.local.posix import PosixTier
from tiering.remote.tier import RemoteTier


def remote_tier(cfg: Config) -> RemoteTier:
    """The run's object store tier; ConfigError if ``checkpoint.s3.uri`` is not set."""
    s3 = cfg.checkpoint.s3
    if not s3.uri:
        raise ConfigError(
            f"{cfg.source}: checkpoint.s3.uri is not set; fix: set it to s3://bucket/prefix or file:///path"
        )
    return RemoteTier.open(
        s3.uri,
        cfg.run.id,
        endpoint_url=s3.endpoint_url,
        concurrency=s3.concurrency,
        multipart_chunk_mb=s3.multipart_chunk_mb,
        checksum_header=s3.checksum_header,
        fault=cfg.fault_tolerance.inject.s3_fault,
        max_attempts=s3.max_attempts,
        connect_timeout_s=s3.connect_timeout_s,
        read_timeout_s=s3.read_timeout_s,
    )


def staging_tier(cfg: Config) -> PosixTier:
    """The reshardable tier the uploader promotes from."""
    tier = cfg.checkpoint.reshardable
    return PosixTier(tier.dir, cfg.run.id, tier.keep, name="reshardable")


def run_upload(
    cfg: Config, *, watch: bool = False, max_seconds: float | None = None, metrics_port: int | None = None
) -> int:
    """``tiering upload`` with the store, run, owner, polling and backoff of ``cfg``."""
    s3 = cfg.checkpoint.s3
    return tiering_cli.upload(
        remote_tier(cfg),
        staging_tier(cfg),
        s3_owner(cfg),
        watch=watch,
        poll_s=s3.poll_s,
        retry_max_s=s3.retry_max_s,
        max_seconds=max_seconds,
        metrics_port=metrics_port,
    )


def run_gc(cfg: Config, *, apply: bool = False) -> int:
    """``tiering gc`` with ``checkpoint.s3.keep`` and ``checkpoint.s3.milestone_every``."""
    s3 = cfg.checkpoint.s3
    return tiering_cli.gc(remote_tier(cfg), s3.keep, s3.milestone_every, apply=apply, min_age_s=s3.gc_min_age_s)

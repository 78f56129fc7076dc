"""``tiering upload``, ``tiering restore`` and ``tiering gc``: the commands on tier 3, the object store.

:func:`upload`, :func:`gc` and :func:`read_suspects` are also what ``pretrain upload`` and
``pretrain gc`` call with a pretrain config mapped onto them. Every step promoted or restored is
checked under the run key (:func:`signer_from`); ``gc`` checks signatures when given the key. The
``*_command`` functions take the parsed flags (:mod:`tiering.commands.main`) and return the exit
status.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from tiering.digest import PORTABLE_HASH
from tiering.errors import AccessDenied, LeaseError, RunKeyError, VerificationError
from tiering.layout import RunLayout
from tiering.local.posix import PosixTier
from tiering.remote.gc import MIN_AGE_S
from tiering.remote.lease import default_owner
from tiering.remote.objectstore import ObjectStoreError
from tiering.remote.tier import RemoteTier
from tiering.remote.uploader import Backoff, Uploader, UploaderMetrics
from tiering.trust.run_key import key_file_from_env, load
from tiering.trust.signature import ManifestSigner


def upload(
    remote: RemoteTier,
    staging: PosixTier,
    owner: str,
    *,
    watch: bool = False,
    poll_s: float = 5.0,
    retry_max_s: float = 60.0,
    max_seconds: float | None = None,
    metrics_port: int | None = None,
) -> int:
    """Promote committed ``staging`` steps to ``remote`` as ``owner``: what is pending, or keep
    polling (``watch``) until SIGTERM or ``max_seconds``, backing off while the store is down;
    ``metrics_port``: serve :class:`tiering.remote.uploader.UploaderMetrics` there.

    Prints ``{"uploaded": [...], "pending": [...]}`` and returns 0; returns 1 with one line on
    stderr if another owner holds the run or the store refuses.
    """
    metrics = None
    if metrics_port is not None:
        metrics = UploaderMetrics(remote.run_id)
        metrics.serve(metrics_port)
    uploader = Uploader(remote, staging, owner, metrics=metrics)
    try:
        if watch:
            stop = threading.Event()
            signal.signal(signal.SIGTERM, lambda *_: stop.set())
            uploader.watch(poll_s, Backoff(cap_s=retry_max_s), stop, max_seconds)
        else:
            uploader.run_once()
    except (LeaseError, ObjectStoreError) as exc:
        print(f"tiering upload: {exc}", file=sys.stderr)
        return 1
    try:
        pending = uploader.pending()
    except ObjectStoreError:  # still unreachable: everything staged is pending
        pending = sorted(staging.committed_steps())
    print(json.dumps({"uploaded": [u.step for u in uploader.uploaded], "pending": pending}))
    return 0


def gc(
    remote: RemoteTier,
    keep: int,
    milestone_every: int = 0,
    *,
    apply: bool = False,
    min_age_s: float = MIN_AGE_S,
    suspects: frozenset[int] = frozenset(),
) -> int:
    """Object store retention (:class:`tiering.retention.ObjectStoreRetention`): a dry run
    unless ``apply``; marks on one pass and deletes on a later one; ``suspects`` never count as
    verified. Prints the plan."""
    plan = remote.gc(keep, milestone_every, dry_run=not apply, min_age_s=min_age_s, suspects=suspects)
    mode = "applied" if apply else "dry run (pass --apply to act)"
    print(f"gc {mode}: keep {plan.keep}; marked now {plan.marked_now}; deleted {plan.deleted}")
    return 0


def read_suspects(path: Path | str | None) -> frozenset[int]:
    """The steps a suspect list (a JSON list of step numbers) names; none when ``path`` is None or
    absent. An unreadable list raises VerificationError (a list that cannot be read must not read
    as "no suspects")."""
    if path is None or not os.path.lexists(path):
        return frozenset()
    try:
        steps = json.loads(Path(path).read_bytes())
        return frozenset(int(s) for s in steps)
    except (OSError, ValueError, TypeError) as exc:
        raise VerificationError(path, f"unreadable suspect list ({exc})", "fix: repair or remove it") from exc


def signer_from(path: Path | str | None, required: bool) -> ManifestSigner | None:
    """The manifest signer of the key in ``path`` (else ``PRETRAIN_RUN_KEY_FILE``); None when
    neither names one and it is not ``required`` (RunKeyError: one line with the fix)."""
    named = Path(path) if path else key_file_from_env()
    if named is None:
        if required:
            raise RunKeyError(
                "no run key: staging and S3 steps are signed with it; fix: pass --run-key-file "
                "or set PRETRAIN_RUN_KEY_FILE (the trainer's key, <run.dir>/<run id>/run.key by default)"
            )
        return None
    return ManifestSigner(load(named))


def _remote(args: argparse.Namespace, signer: ManifestSigner | None = None) -> RemoteTier:
    return RemoteTier.open(
        args.uri,
        args.run_id,
        endpoint_url=args.endpoint_url,
        concurrency=args.concurrency,
        multipart_chunk_mb=args.multipart_chunk_mb,
        checksum_header=args.checksum_header,
        fault=getattr(args, "inject_fault", None),
        max_attempts=getattr(args, "max_attempts", 5),
        signer=signer,
        expect_hash=PORTABLE_HASH,
    )


def upload_command(args: argparse.Namespace) -> int:
    signer = signer_from(args.run_key_file, required=True)
    staging = PosixTier(args.staging_dir, args.run_id, name="reshardable", expect_hash=PORTABLE_HASH, signer=signer)
    return upload(
        _remote(args, signer),
        staging,
        args.owner or default_owner(),
        watch=args.watch,
        poll_s=args.poll_s,
        retry_max_s=args.retry_max_s,
        max_seconds=args.max_seconds,
        metrics_port=args.metrics_port,
    )


def gc_command(args: argparse.Namespace) -> int:
    return gc(
        _remote(args, signer_from(args.run_key_file, required=False)),
        args.keep,
        args.milestone_every,
        apply=args.apply,
        min_age_s=args.min_age_s,
        suspects=read_suspects(args.suspects),
    )


def restore_command(args: argparse.Namespace) -> int:
    """Download the newest verified S3 step unless the local tier already holds one as new.

    ``--allow-none`` (the Kubernetes init container) exits 0 when there is nothing to restore or
    the store is unreachable: the trainer then starts from its local/peer tiers or from step 0,
    and retries S3 itself.
    """
    signer = signer_from(args.run_key_file, required=True)
    suspects = read_suspects(args.suspects)
    remote = RemoteTier.open(
        args.uri, args.run_id, endpoint_url=args.endpoint_url, signer=signer, expect_hash=PORTABLE_HASH
    )
    layout = RunLayout(Path(args.to), args.run_id)
    soft = 0 if args.allow_none else 1
    local = PosixTier(Path(args.to), args.run_id, expect_hash=PORTABLE_HASH, signer=signer)
    local_best = next((s for s in local.committed_steps() if s not in suspects and _verifies(local, s)), None)
    try:
        remote_steps = [s for s in remote.committed_steps() if s not in suspects]
        if local_best is not None and (not remote_steps or remote_steps[0] <= local_best):
            print(f"local step {local_best} in {layout.steps_dir} verifies and is as new as S3's; nothing to download")
            return 0
        step, rejected = remote.restore_newest(layout, f"restore-{int(time.time())}", exclude=suspects)
    except ObjectStoreError as exc:
        print(f"tiering restore: {exc}", file=sys.stderr)
        # A refused identity is a deployment error, not an outage: fail the pod where it shows,
        # rather than train on from an older tier (or from step 0) while S3 holds newer steps.
        return 1 if isinstance(exc, AccessDenied) else soft
    for bad_step, reason in rejected:
        print(f"rejected step {bad_step}: {reason}")
    if step is None:
        print(f"tiering restore: no verified step of run {args.run_id} at {args.uri}", file=sys.stderr)
        return soft
    print(f"restored step {step} -> {layout.step_dir(step)} (verified)")
    return 0


def _verifies(tier: PosixTier, step: int) -> bool:
    try:
        tier.verify(step)
        return True
    except VerificationError:
        return False

"""``tiering`` command line: inspect, verify, promote, restore and collect checkpoint tiers.

* ``tiering ls DIR``: steps of a run directory (``<tier root>/<run id>``) or of every run under a
  tier root: state, size, age, the container image it was written from, the hash its files are
  checked with (from its manifest) and whether it verifies. A tier-0 root (``checkpoint.memory.dir``,
  or one run in it) lists every rank's slots instead, and the peer copies held there (``peer/K``).
* ``tiering verify STEP_DIR``: exit 0 if the step verifies, 1 (with the reason) if not (a tier-0
  slot directory is a step directory too).
* ``tiering upload URI --run-id ID --staging-dir DIR``: promote committed staging steps to the
  object store (``--once`` or ``--watch``).
* ``tiering restore URI --run-id ID --to DIR``: download the newest verified step.
* ``tiering gc URI --run-id ID [--keep N] [--milestone-every M] [--apply]``: object store retention.

``upload`` and ``restore`` need the run key (``--run-key-file``, or ``PRETRAIN_RUN_KEY_FILE``): a
staging or S3 step whose ``SIGNATURE`` does not verify under it is never promoted nor restored
(:mod:`tiering.signature`); ``gc`` checks signatures when given the key. A missing or unusable key
is one line and exit status 2, as is an unreadable suspect list. ``--suspects FILE`` (a JSON list
of steps, the trainer's ``suspect-steps.json``): steps ``restore`` never downloads and ``gc``
never counts as verified.

Every setting is a flag: the package reads no training config. ``pretrain upload`` and
``pretrain gc`` map a pretrain config onto :func:`upload` and :func:`gc`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

from tiering.digest import PORTABLE_HASH
from tiering.errors import AccessDenied, LeaseError, RunKeyError, VerificationError
from tiering.layout import RunLayout, parse_tmp_name
from tiering.local.posix import PosixTier, StepStatus
from tiering.manifest import MANIFEST_NAME, Manifest
from tiering.memory.slot_store import PEERS_DIR, SlotStore, is_slot_dir, parse_rank_dir
from tiering.peer.run_key import key_file_from_env, load
from tiering.remote.gc import MIN_AGE_S
from tiering.remote.lease import default_owner
from tiering.remote.objectstore import ObjectStoreError
from tiering.remote.tier import RemoteTier
from tiering.remote.uploader import Backoff, Uploader, UploaderMetrics
from tiering.signature import ManifestSigner
from tiering.verify import verify_step


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{n} B"


def _human_age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _short_image(image: str) -> str:
    """``sha256:<64 hex>`` (or ``repo@sha256:...``) as ``sha256:<12 hex>``; ``-`` when not recorded."""
    if not image:
        return "-"
    digest = image.rsplit("@", 1)[-1]
    algo, _, hexpart = digest.partition(":")
    return f"{algo}:{hexpart[:12]}" if hexpart else digest[:19]


def _hash_names(manifest: Manifest) -> str:
    """The hashes a step's files are checked with (``blake3``, ``xxh3-128``; a v1 entry: ``sha256``)."""
    return "+".join(sorted({f.hash or "sha256" for f in manifest.files})) or "-"


def _hash_names_of(step_dir: Path) -> str:
    """:func:`_hash_names` of a step directory's manifest; ``-`` when it cannot be read."""
    try:
        return _hash_names(Manifest.from_json((step_dir / MANIFEST_NAME).read_bytes(), step_dir))
    except (OSError, VerificationError):
        return "-"


def _run_dirs(path: Path) -> list[Path]:
    if (path / "steps").is_dir():
        return [path]
    return sorted(p for p in path.iterdir() if (p / "steps").is_dir()) if path.is_dir() else []


def _is_node_root(path: Path) -> bool:
    return (path / "ranks").is_dir() or (path / "replicas").is_dir()


def _ls_node_roots(roots: list[Path], factor: int, as_json: bool) -> int:
    """Per-rank tiers 1-2: per step, which ranks have primary and replica copies, and whether they verify."""
    from tiering.peer.restore import scan_node_root  # imports torch (~1 s): only this listing needs it

    merged: dict[int, dict[str, dict[int, list[str]]]] = {}
    for root in roots:
        for step, kinds in scan_node_root(root, root.name).items():
            for kind, owners in kinds.items():
                for owner, status in owners.items():
                    merged.setdefault(step, {}).setdefault(kind, {}).setdefault(owner, []).append(
                        f"{root.parent.name}/{root.name}: {status}"
                    )
    rows = []
    for step in sorted(merged, reverse=True):
        kinds = merged[step]
        owners = sorted({o for per in kinds.values() for o in per})
        good = {o: sum(s.endswith(": ok") for k in kinds.values() for s in k.get(o, [])) for o in owners}
        under = [o for o in owners if good[o] < factor]
        bad = [s for k in kinds.values() for lst in k.values() for s in lst if not s.endswith(": ok")]
        rows.append(
            {
                "step": step,
                "primary": {o: kinds.get("primary", {}).get(o, []) for o in owners},
                "replica": {o: kinds.get("replica", {}).get(o, []) for o in owners},
                "verified_copies": good,
                "under_replicated": under,
                "bad": bad,
            }
        )
    if as_json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"per-rank local tier: {', '.join(map(str, roots))} (replication factor {factor})")
    print(f"  {'STEP':>10}  {'PRIMARY (rank:copies ok)':<28}  {'REPLICA':<28}  STATUS")
    for row in rows:
        prim = " ".join(f"{o}:{sum(x.endswith(': ok') for x in v)}" for o, v in row["primary"].items() if v) or "-"
        repl = " ".join(f"{o}:{sum(x.endswith(': ok') for x in v)}" for o, v in row["replica"].items() if v) or "-"
        status = "ok" if not row["under_replicated"] else f"UNDER-REPLICATED ranks {row['under_replicated']}"
        if row["bad"]:
            status += f"; {len(row['bad'])} copies fail verification: {row['bad'][0]}"
        print(f"  {row['step']:>10}  {prim:<28}  {repl:<28}  {status}")
    return 0


def _memory_runs(path: Path) -> list[Path]:
    """Tier-0 run directories at ``path`` (``<root>/<run>/rank-NNNNN/slot-K``): itself or its children."""

    def is_run(p: Path) -> bool:
        return p.is_dir() and any(parse_rank_dir(r.name) is not None for r in p.iterdir() if r.is_dir())

    if is_run(path):
        return [path]
    return sorted(p for p in path.iterdir() if is_run(p)) if path.is_dir() else []


def _slot_rows(run: Path, verify: bool) -> list[dict[str, object]]:
    """Every rank's own slots, then the peer copies held here (``slot`` shown as ``peer/K``)."""
    rows: list[dict[str, object]] = []
    for base, peer in ((run, False), (run / PEERS_DIR, True)):
        for rank_dir in (
            sorted(p for p in base.iterdir() if parse_rank_dir(p.name) is not None) if base.is_dir() else []
        ):
            rows += _rank_slot_rows(run, rank_dir, peer, verify)
    return rows


def _rank_slot_rows(run: Path, rank_dir: Path, peer: bool, verify: bool) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    rank = parse_rank_dir(rank_dir.name)
    assert rank is not None
    slots = sorted(p for p in rank_dir.iterdir() if is_slot_dir(p))
    store = SlotStore(run.parent, run.name, rank, len(slots), peer=peer)
    for slot_dir in slots:
        index = int(slot_dir.name.split("-")[1])
        view = store.view(index)
        payload = store.state_path(index)
        shown = f"peer/{index}" if peer else index
        row: dict[str, object] = {"rank": rank, "slot": shown, "state": view.state.value, "step": view.step}
        row.update(sequence=view.sequence, bytes=payload.stat().st_size if payload.is_file() else 0)
        row["age_s"] = round(time.time() - payload.stat().st_mtime, 1) if payload.is_file() else None
        row["verified"], row["reason"] = None, None
        if verify and view.step is not None:
            try:
                verify_step(slot_dir, expect_run_id=run.name)
                row["verified"] = True
            except (VerificationError, OSError) as exc:
                row["verified"], row["reason"] = False, str(exc)
        rows.append(row)
    quarantined = rank_dir / "quarantine"
    for bad in sorted(quarantined.iterdir()) if quarantined.is_dir() else []:
        where = f"peer/quarantine/{bad.name}" if peer else f"quarantine/{bad.name}"
        rows.append({"rank": rank, "slot": where, "state": "quarantined"})
    return rows


def _ls_memory(runs: list[Path], verify: bool, as_json: bool) -> int:
    """Tier 0: every rank's slots (sealed or not, step, sequence, size, age, verification)."""
    report = [{"run": str(run), "slots": _slot_rows(run, verify)} for run in runs]
    if as_json:
        print(json.dumps(report, indent=1))
        return 0
    for entry in report:
        print(f"tier 0 (memory) run {entry['run']}")
        print(f"  {'RANK':>5}  {'SLOT':<6}  {'STATE':<11}  {'STEP':>8}  {'SEQ':>6}  {'SIZE':>10}  {'AGE':>6}  VERIFIED")
        for r in entry["slots"]:
            if r["state"] == "quarantined":
                print(f"  {r['rank']:>5}  {r['slot']}")
                continue
            verified = "-" if r["verified"] is None else ("yes" if r["verified"] else f"NO: {r['reason']}")
            age = _human_age(float(r["age_s"])) if r["age_s"] is not None else "-"
            step = "-" if r["step"] is None else r["step"]
            seq = "-" if r["sequence"] is None else r["sequence"]
            size = _human_bytes(int(r["bytes"]))
            where = f"{r['rank']:>5}  {r['slot']:<6}  {r['state']:<11}"
            print(f"  {where}  {step:>8}  {seq:>6}  {size:>10}  {age:>6}  {verified}")
    return 0


def _ls(args: argparse.Namespace) -> int:
    roots = [Path(d) for d in args.dir]
    if all(_is_node_root(r) for r in roots):
        return _ls_node_roots(roots, args.factor, args.json)
    memory = _memory_runs(roots[0])
    if memory:
        return _ls_memory(memory, not args.no_verify, args.json)
    root = roots[0]
    runs = _run_dirs(root)
    if not runs:
        print(f"tiering ls: {root}: no run directory (expected <dir>/steps/ or <dir>/<run>/steps/)", file=sys.stderr)
        return 2
    report = []
    for run in runs:
        tier = PosixTier(run.parent, run.name)
        rows: list[StepStatus] = tier.status(verify=not args.no_verify)
        pending = sorted(p.name for p in tier.layout.steps_dir.iterdir() if parse_tmp_name(p.name))
        quarantined = (
            sorted(p.name for p in tier.layout.quarantine_dir.glob("step-*") if p.is_dir())
            if tier.layout.quarantine_dir.is_dir()
            else []
        )
        report.append((run, tier.latest_hint(), rows, pending, quarantined))
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "run": str(run),
                        "latest_hint": hint,
                        "steps": [
                            {
                                "step": r.step,
                                "committed": r.committed,
                                "bytes": r.bytes,
                                "age_s": round(r.age_s, 1),
                                "verified": r.verified,
                                "reason": r.reason,
                                "image": r.image,
                            }
                            for r in rows
                        ],
                        "in_progress": pending,
                        "quarantined": quarantined,
                    }
                    for run, hint, rows, pending, quarantined in report
                ],
                indent=1,
            )
        )
        return 0
    for run, hint, rows, pending, quarantined in report:
        print(f"run {run}  (latest.json hint: {hint if hint is not None else 'none'})")
        print(f"  {'STEP':>10}  {'STATE':<11}  {'SIZE':>10}  {'AGE':>6}  {'IMAGE':<19}  {'HASH':<8}  VERIFIED")
        for r in rows:
            state = "committed" if r.committed else "uncommitted"
            verified = "-" if r.verified is None else ("yes" if r.verified else f"NO: {r.reason}")
            size, age = _human_bytes(r.bytes), _human_age(r.age_s)
            image, hashes = _short_image(r.image), _hash_names_of(r.path)
            print(f"  {r.step:>10}  {state:<11}  {size:>10}  {age:>6}  {image:<19}  {hashes:<8}  {verified}")
        for name in pending:
            print(f"  {name}  in progress (or left by a dead attempt)")
        for name in quarantined:
            print(f"  quarantine/{name}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    step_dir = Path(args.step_dir)
    t0 = time.perf_counter()
    try:
        manifest = verify_step(
            step_dir, expect_run_id=RunLayout.from_step_dir(step_dir).run_id if args.strict_run else None
        )
    except VerificationError as exc:
        print(f"NOT VERIFIED: {exc}")
        return 1
    except OSError as exc:
        print(f"NOT VERIFIED: {exc.filename or step_dir}: {exc.strerror or exc}")
        return 1
    dt = time.perf_counter() - t0
    print(
        f"verified: {step_dir} step {manifest.step} of run {manifest.run_id}: {len(manifest.files)} files, "
        f"{_human_bytes(manifest.total_bytes)}, {_hash_names(manifest)} ok ({dt:.2f}s)"
    )
    return 0


def configure_logging() -> None:
    """What every ``tiering`` command logs: INFO and above to stderr."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


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


def _upload(args: argparse.Namespace) -> int:
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


def _gc(args: argparse.Namespace) -> int:
    return gc(
        _remote(args, signer_from(args.run_key_file, required=False)),
        args.keep,
        args.milestone_every,
        apply=args.apply,
        min_age_s=args.min_age_s,
        suspects=read_suspects(args.suspects),
    )


def _restore(args: argparse.Namespace) -> int:
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


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1")
    return value


def _store_flags(parser: argparse.ArgumentParser) -> None:
    """Where the run lives in the object store, and how to talk to it."""
    parser.add_argument("uri", help="s3://bucket/prefix or file:///path")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--endpoint-url", default=None, help="S3-compatible stores (Ceph RGW, MinIO, ...)")
    parser.add_argument("--concurrency", type=_positive, default=8, help="parallel transfers")
    parser.add_argument("--multipart-chunk-mb", type=int, default=64, help="multipart part size (S3: >= 5)")
    parser.add_argument("--checksum-header", action="store_true", help="also send x-amz-checksum-sha256")


def _key_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run-key-file", default=None, help="the run key (default: PRETRAIN_RUN_KEY_FILE); steps are signed with it"
    )


def _suspects_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--suspects", default=None, metavar="FILE", help="JSON list of poisoned steps (suspect-steps.json) to skip"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiering", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="list steps with state, size, age and verification")
    ls.add_argument(
        "dir",
        nargs="+",
        help="a run directory (<root>/<run id>), a tier root, or the per-rank local "
        "roots (<checkpoint.local.dir>/<run id>) of one or more nodes",
    )
    ls.add_argument("--factor", type=int, default=2, help="copies each rank's step should have (tiers 1-2)")
    ls.add_argument("--no-verify", action="store_true", help="skip hashing (structure only)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_ls)
    v = sub.add_parser("verify", help="verify one step directory (exit 0 verified, 1 not)")
    v.add_argument("step_dir")
    v.add_argument("--strict-run", action="store_true", help="also require the manifest's run id to match the path")
    v.set_defaults(func=_verify)
    up = sub.add_parser("upload", help="promote committed staging steps to an object store")
    _store_flags(up)
    up.add_argument(
        "--staging-dir", required=True, help="the reshardable tier root; steps are in <dir>/<run id>/steps/"
    )
    up.add_argument("--owner", default=None, help="lease identity (default: RP_RUN_OWNER, else user@host)")
    up.add_argument("--poll-s", type=float, default=5.0, help="--watch polling period")
    up.add_argument("--retry-max-s", type=float, default=60.0, help="backoff cap while the store is unreachable")
    up.add_argument(
        "--max-attempts", type=_positive, default=5, help="S3 client tries per request before the uploader backs off"
    )
    mode = up.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="upload what is pending and exit (default)")
    mode.add_argument("--watch", action="store_true", help="keep polling the staging directory")
    up.add_argument("--max-seconds", type=float, default=None, help="stop watching after this long")
    up.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    up.add_argument(
        "--inject-fault",
        default=None,
        metavar="SPEC",
        help="tests and drills: kill_after_parts=N (SIGKILL after N parts) or timeout_parts=N",
    )
    _key_flag(up)
    up.set_defaults(func=_upload)
    r = sub.add_parser("restore", help="download the newest verified step from an object store")
    r.add_argument("uri", help="s3://bucket/prefix or file:///path")
    r.add_argument("--run-id", required=True)
    r.add_argument("--to", required=True, help="local tier root; the step lands in <to>/<run id>/steps/")
    r.add_argument("--endpoint-url", default=None)
    r.add_argument(
        "--allow-none",
        action="store_true",
        help="exit 0 when S3 has no verified step or cannot be reached (init containers)",
    )
    _key_flag(r)
    _suspects_flag(r)
    r.set_defaults(func=_restore)
    g = sub.add_parser("gc", help="retention on the object store (dry run unless --apply)")
    _store_flags(g)
    g.add_argument("--keep", type=_positive, default=3, help="newest verified steps kept (and the one before)")
    g.add_argument("--milestone-every", type=int, default=0, help="also keep steps divisible by this (0: none)")
    g.add_argument("--apply", action="store_true")
    g.add_argument(
        "--min-age-s", type=float, default=MIN_AGE_S, help="delete a marked step only once its mark is this old"
    )
    _key_flag(g)
    _suspects_flag(g)
    g.set_defaults(func=_gc)
    return parser


def _config_moved(argv: list[str]) -> str | None:
    """The one-line answer to ``tiering upload/gc --config FILE`` (how they were run before)."""
    flags = [arg.partition("=") for arg in argv]
    at = next((i for i, (name, _, _) in enumerate(flags) if name == "--config"), None)
    if at is None or argv[0] not in ("upload", "gc"):
        return None
    config = flags[at][2] or (argv[at + 1] if at + 1 < len(argv) else "the config")
    return (
        f"tiering {argv[0]}: {config}: tiering reads no training config; "
        f"fix: run 'pretrain {argv[0]} --config {config} ...', or pass the store and run as flags "
        f"(tiering {argv[0]} --help)"
    )


def main(argv: list[str] | None = None) -> int:
    # torch warns about a deprecated pynvml on every import: noise for CLI users.
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
    os.umask(0o077)  # restored or downloaded steps are private to the user
    configure_logging()
    argv = sys.argv[1:] if argv is None else argv
    moved = _config_moved(argv)
    if moved:
        print(moved, file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (RunKeyError, VerificationError) as exc:  # a key or a suspect list that cannot be used
        print(f"tiering {args.command}: {exc}", file=sys.stderr)
        return 2

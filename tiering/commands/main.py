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
(:mod:`tiering.trust.signature`); ``gc`` checks signatures when given the key. A missing or unusable key
is one line and exit status 2, as is an unreadable suspect list. ``--suspects FILE`` (a JSON list
of steps, the trainer's ``suspect-steps.json``): steps ``restore`` never downloads and ``gc``
never counts as verified.

Every setting is a flag: the package reads no training config. ``pretrain upload`` and
``pretrain gc`` map a pretrain config onto :func:`tiering.commands.object_store.upload` and
:func:`tiering.commands.object_store.gc`. The subcommands live in :mod:`tiering.commands.listing`
(``ls``, ``verify``) and :mod:`tiering.commands.object_store` (``upload``, ``restore``, ``gc``);
this module parses the flags and maps failures to exit statuses.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from tiering.commands.listing import ls_command, verify_command
from tiering.commands.object_store import gc_command, restore_command, upload_command
from tiering.errors import RunKeyError, VerificationError
from tiering.remote.gc import MIN_AGE_S


def configure_logging() -> None:
    """What every ``tiering`` command logs: INFO and above to stderr."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


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
    ls.set_defaults(func=ls_command)
    v = sub.add_parser("verify", help="verify one step directory (exit 0 verified, 1 not)")
    v.add_argument("step_dir")
    v.add_argument("--strict-run", action="store_true", help="also require the manifest's run id to match the path")
    v.set_defaults(func=verify_command)
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
    up.set_defaults(func=upload_command)
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
    r.set_defaults(func=restore_command)
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
    g.set_defaults(func=gc_command)
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

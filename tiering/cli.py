"""``tiering`` command line: inspect and verify checkpoint tiers.

* ``tiering ls DIR``: steps of a run directory (``<tier root>/<run id>``) or of every run under a
  tier root: state, size, age and whether each step verifies.
* ``tiering verify STEP_DIR``: exit 0 if the step verifies, 1 (with the reason) if not.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

from tiering.errors import VerificationError
from tiering.layout import RunLayout, parse_tmp_name
from tiering.local import LocalTier, StepStatus
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


def _run_dirs(path: Path) -> list[Path]:
    if (path / "steps").is_dir():
        return [path]
    return sorted(p for p in path.iterdir() if (p / "steps").is_dir()) if path.is_dir() else []


def _is_node_root(path: Path) -> bool:
    return (path / "ranks").is_dir() or (path / "replicas").is_dir()


def _ls_node_roots(roots: list[Path], factor: int, as_json: bool) -> int:
    """Per-rank tiers 1-2: per step, which ranks have primary and replica copies, and whether they verify."""
    from tiering.peer_restore import scan_node_root

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


def _ls(args: argparse.Namespace) -> int:
    roots = [Path(d) for d in args.dir]
    if all(_is_node_root(r) for r in roots):
        return _ls_node_roots(roots, args.factor, args.json)
    root = roots[0]
    runs = _run_dirs(root)
    if not runs:
        print(f"tiering ls: {root}: no run directory (expected <dir>/steps/ or <dir>/<run>/steps/)", file=sys.stderr)
        return 2
    report = []
    for run in runs:
        tier = LocalTier(run.parent, run.name)
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
        print(f"  {'STEP':>10}  {'STATE':<11}  {'SIZE':>10}  {'AGE':>6}  VERIFIED")
        for r in rows:
            state = "committed" if r.committed else "uncommitted"
            verified = "-" if r.verified is None else ("yes" if r.verified else f"NO: {r.reason}")
            print(f"  {r.step:>10}  {state:<11}  {_human_bytes(r.bytes):>10}  {_human_age(r.age_s):>6}  {verified}")
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
        f"{_human_bytes(manifest.total_bytes)}, SHA-256 ok ({dt:.2f}s)"
    )
    return 0


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
    return parser


def main(argv: list[str] | None = None) -> int:
    # torch warns about a deprecated pynvml on every import: noise for CLI users.
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
    args = build_parser().parse_args(argv)
    return args.func(args)

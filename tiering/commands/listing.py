"""``tiering ls`` and ``tiering verify``: read-only views of a tier, nothing written.

``ls`` lists the steps of a run directory or of every run under a tier root (state, size, age, the
image a step was written from, its hashes, whether it verifies), every rank's tier-0 slots and
their peer copies, or, given the per-rank local roots of several nodes, which ranks hold a verified
primary and replica of each step. ``verify`` checks one step directory (a tier-0 slot too). Both
return the command's exit status; :mod:`tiering.commands.main` parses the flags.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tiering.errors import VerificationError
from tiering.layout import RunLayout, parse_tmp_name
from tiering.local.posix import PosixTier, StepStatus
from tiering.manifest import MANIFEST_NAME, Manifest
from tiering.memory.slot_store import PEERS_DIR, SlotStore, is_slot_dir, parse_rank_dir
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


def ls_command(args: argparse.Namespace) -> int:
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


def verify_command(args: argparse.Namespace) -> int:
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

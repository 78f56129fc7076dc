"""Steps in a POSIX directory under the publish protocol: listing, verification, quarantine, pins, retention.

One class serves every file-system tier: the node-local per-rank primaries (tier 1), the replicas
peers hold (tier 2), and the shared reshardable staging tier that feeds the object store.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from tiering.errors import VerificationError
from tiering.layout import RunLayout, parse_step_name, parse_tmp_name
from tiering.local.pins import StepPin, held_steps
from tiering.manifest import COMMITTED_NAME, MANIFEST_NAME, Manifest
from tiering.retention import KeepNewest, RetentionPolicy
from tiering.system.fsio import atomic_write_bytes, dir_size, fsync_dir
from tiering.trust.signature import ManifestSigner
from tiering.verify import read_manifest, verify_step

log = logging.getLogger(__name__)

QUARANTINE_KEEP_S = 3 * 24 * 3600.0  # how long a quarantined step is kept as evidence


@dataclass
class StepStatus:
    step: int
    path: Path
    committed: bool
    bytes: int
    age_s: float
    verified: bool | None
    reason: str = ""
    image: str = ""  # the container image the step was written from (manifest framework.image_digest)


class PosixTier:
    """Published steps under ``<root>/<dirname>/steps`` on any POSIX file system.

    ``dirname`` is the run id for a whole-run store (the reshardable tier), or ``rank-NNNNN`` for
    a per-rank primary or replica store; ``run_id`` (default: ``dirname``) is what manifests
    must name. ``signer``: the tier's steps are signed (the reshardable tier): a step whose
    ``SIGNATURE`` is missing or forged never verifies, nor counts as kept by retention.
    """

    def __init__(
        self,
        root: Path | str,
        dirname: str,
        keep: int = 3,
        *,
        run_id: str | None = None,
        name: str = "local",
        expect_hash: str | None = None,
        signer: ManifestSigner | None = None,
    ) -> None:
        self.layout = RunLayout(Path(root), dirname)
        self.expect_hash = expect_hash  # the one digest this tier's steps may use (None: any known one)
        self.signer = signer
        self.policy: RetentionPolicy = KeepNewest(keep)
        self.run_id = run_id or dirname
        self.name = name

    # -- discovery ---------------------------------------------------------------------------
    def step_dirs(self) -> list[int]:
        """Every published-looking ``step-N`` directory, newest first (marker not checked)."""
        if not self.layout.steps_dir.is_dir():
            return []
        steps = (parse_step_name(p.name) for p in self.layout.steps_dir.iterdir())
        return sorted((s for s in steps if s is not None), reverse=True)

    def committed_steps(self) -> list[int]:
        return [s for s in self.step_dirs() if (self.layout.step_dir(s) / COMMITTED_NAME).is_file()]

    def latest_hint(self) -> int | None:
        """The step ``latest.json`` names, or None if it is absent or unreadable (it is only a hint)."""
        path = self.layout.latest_path
        if not path.exists():
            return None
        try:
            body = json.loads(path.read_text(encoding="utf-8"))
            step = body["step"]
            if not isinstance(step, int) or isinstance(step, bool):
                raise TypeError("step is not an integer")
            return step
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("%s: unreadable latest.json (%s); ignoring the hint and scanning steps", path, exc)
            return None

    def step_path(self, step: int) -> Path:
        return self.layout.step_dir(step)

    # -- verification ------------------------------------------------------------------------
    def verify(self, step: int, shard: tuple[int, int] = (0, 1)) -> Manifest:
        return verify_step(
            self.layout.step_dir(step),
            expect_run_id=self.run_id,
            shard=shard,
            expect_hash=self.expect_hash,
            signer=self.signer,
        )

    def quarantine(self, step: int, reason: str) -> Path | None:
        """Move ``step-N`` to ``quarantine/`` with a reason file (reclaimed after
        ``QUARANTINE_KEEP_S``, or at once when the volume is full: :meth:`reclaim_quarantine`)."""
        src = self.layout.step_dir(step)
        if not src.exists():
            return None
        qdir = self.layout.quarantine_dir
        qdir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        dst = qdir / f"{src.name}.{stamp}-{uuid.uuid4().hex[:6]}"
        os.rename(src, dst)
        fsync_dir(src.parent)
        atomic_write_bytes(dst.with_name(dst.name + ".reason.txt"), (reason.rstrip() + "\n").encode())
        log.warning("quarantined %s -> %s: %s", src, dst, reason)
        return dst

    # -- housekeeping ------------------------------------------------------------------------
    def reclaim_quarantine(self, older_than_s: float = QUARANTINE_KEEP_S) -> list[str]:
        """Delete quarantined steps whose reason file is older than ``older_than_s`` (the evidence
        is kept that long); returns their names."""
        qdir = self.layout.quarantine_dir
        if not qdir.is_dir():
            return []
        gone = []
        now = time.time()
        for reason in sorted(qdir.glob("*.reason.txt")):
            try:
                if now - reason.stat().st_mtime < older_than_s:
                    continue
            except FileNotFoundError:
                continue
            moved = reason.with_name(reason.name.removesuffix(".reason.txt"))
            shutil.rmtree(moved, ignore_errors=True)
            reason.unlink(missing_ok=True)
            gone.append(moved.name)
        return gone

    def clean_stale_tmp(self, current_attempt: str) -> list[Path]:
        """Remove temporary step directories of earlier attempts (their writers are gone)."""
        removed = []
        if not self.layout.steps_dir.is_dir():
            return removed
        for path in self.layout.steps_dir.iterdir():
            parsed = parse_tmp_name(path.name)
            if parsed and parsed[1] != current_attempt:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        return removed

    # -- pins: a step in use by another process (an upload, a restore) is never deleted ----------
    def pin(self, step: int, holder: str) -> StepPin:
        """A lease on ``step`` for this process (see :mod:`tiering.local.pins`); release it when done."""
        return StepPin(self.layout.run_dir / "pins", step, holder)

    def pinned_steps(self) -> set[int]:
        return held_steps(self.layout.run_dir / "pins")

    def make_room(self, protected: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """A full volume: drop every step but the newest verified one (and pinned and ``protected``
        ones), oldest first; returns the steps deleted. The newest step whose every byte verifies is
        kept too (a newer one whose manifest reads but whose bytes are torn does not stand in for
        it). The next save then needs room for one step beside it."""
        for name in self.reclaim_quarantine(0.0):  # evidence goes before any committed step
            log.warning("%s: quarantined %s deleted to make room", self.layout.quarantine_dir, name)
        keep = set(protected)
        for step in self.committed_steps():  # newest first
            try:
                self.verify(step)
            except VerificationError:
                continue
            keep.add(step)
            break
        return self.apply_retention(protected=keep, policy=KeepNewest(1))

    def apply_retention(
        self, protected: set[int] | frozenset[int] = frozenset(), policy: RetentionPolicy | None = None
    ) -> list[int]:
        """Delete steps beyond the policy (default: this tier's). Structural verification decides which
        steps count as kept; steps pinned by a live process (an upload in progress, say) are kept."""
        protected = set(protected) | self.pinned_steps()
        committed = self.committed_steps()
        for step in [s for s in self.step_dirs() if committed and s < committed[0] and s not in committed]:
            # Left behind by an earlier deletion (see below): no longer committed, retried here.
            shutil.rmtree(self.layout.step_dir(step), ignore_errors=True)
        verified = []
        for step in committed:
            try:
                read_manifest(self.layout.step_dir(step), self.signer)
                verified.append(step)
            except VerificationError:
                continue
        self.reclaim_quarantine()
        doomed = (policy or self.policy).deletable(verified, protected)
        for step in doomed:
            path = self.layout.step_dir(step)
            # Remove the marker first: a crash mid-delete leaves an uncommitted step, never a torn committed one.
            (path / COMMITTED_NAME).unlink(missing_ok=True)
            fsync_dir(path)
            try:
                shutil.rmtree(path)
            except OSError as exc:
                # A file of it still open elsewhere (NFS renames it to .nfsXXXX, a FUSE filesystem
                # to .fuse_hiddenXXXX) keeps the directory: the step is no longer committed, its
                # space comes back when that file is closed, and the save that needed room goes on.
                log.warning("%s: deleted step %d left behind (%s); freed when its open files close", path, step, exc)
        return doomed

    def status(self, verify: bool = True) -> list[StepStatus]:
        out = []
        now = time.time()
        for step in self.step_dirs():
            path = self.layout.step_dir(step)
            committed = (path / COMMITTED_NAME).is_file()
            verified: bool | None = None
            reason = ""
            if verify:
                try:
                    self.verify(step)
                    verified = True
                except VerificationError as exc:
                    verified, reason = False, str(exc)
            age = now - path.stat().st_mtime
            out.append(StepStatus(step, path, committed, dir_size(path), age, verified, reason, _image_of(path)))
        return out


def _image_of(step_dir: Path) -> str:
    """The image digest a step's manifest records ("unknown" outside a container, "" if unreadable)."""
    try:
        body = json.loads((step_dir / MANIFEST_NAME).read_bytes())
    except (OSError, ValueError):
        return ""
    framework = body.get("framework") if isinstance(body, dict) else None
    return str(framework.get("image_digest", "")) if isinstance(framework, dict) else ""


# Where a node keeps a rank's own steps and the replicas it holds of others (tier 1 and tier 2).
# Here, beside the tier, not with the replication: the node's agent finds a rank's store without
# importing the transport (torch: seconds of start-up on a loaded node).
def primary_store(node_root: Path, owner: int, run_id: str, keep: int) -> PosixTier:
    return PosixTier(node_root / "ranks", f"rank-{owner:05d}", keep, run_id=run_id, name="local")


def replica_store(node_root: Path, owner: int, run_id: str, keep: int) -> PosixTier:
    return PosixTier(node_root / "replicas", f"rank-{owner:05d}", keep, run_id=run_id, name="peer")

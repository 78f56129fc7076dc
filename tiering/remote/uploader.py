"""``tiering upload``: a separate process that promotes committed staging steps to the object store.

It never runs inside the trainer: a slow or unreachable store costs training nothing. Steps are
uploaded oldest first, each pinned against staging retention while in flight. On start it aborts
stale multipart uploads of its own run, so a SIGKILLed predecessor leaves no debris, and redoes
(or finishes, keeping objects whose size and whole-file digest, tagged with its hash in the
object's metadata, already match the manifest) any step without COMMITTED.

:class:`UploaderMetrics` is what it tells Prometheus (``--metrics-port``): the newest step it
promoted and when (on start, the newest step already committed in the store and the time of its
COMMITTED object, so a restarted uploader does not look fresh), that time's age, the steps waiting
and the failures. monitoring/alerts.yaml's S3 ``CheckpointStale`` and ``CheckpointPromotionFailing``
read them.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from tiering.errors import CheckpointError, LeaseError, VerificationError
from tiering.layout import parse_step_name
from tiering.local.posix import PosixTier
from tiering.manifest import COMMITTED_NAME
from tiering.remote.objectstore import ObjectStoreError
from tiering.remote.tier import RemoteTier
from tiering.remote.upload import UploadResult

log = logging.getLogger(__name__)


@dataclass
class Backoff:
    """Capped exponential backoff with jitter: the n-th consecutive failure waits a random time in
    ``(ceiling * (1 - jitter), ceiling]`` where ``ceiling = min(cap_s, base_s * 2**(n-1))``, so many
    uploaders throttled by one store (503 SlowDown) do not retry in lock step."""

    base_s: float = 1.0
    cap_s: float = 60.0
    jitter: float = 0.5  # fraction of the ceiling that is randomised (0: exact powers of two)
    failures: int = 0
    rng: random.Random = field(default_factory=random.Random)

    def ceiling(self) -> float:
        return min(self.cap_s, self.base_s * 2 ** min(self.failures - 1, 62))

    def next_delay(self) -> float:
        self.failures += 1
        return self.ceiling() * (1.0 - self.jitter * self.rng.random())

    def reset(self) -> None:
        self.failures = 0


class UploaderMetrics:
    """The uploader's Prometheus series, labelled with the run id, in a registry of their own."""

    def __init__(self, run_id: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.run_id = run_id
        labels = ["run_id"]
        self.last_step = Gauge(
            "uploader_last_promoted_step", "Newest step committed in the object store", labels, registry=self.registry
        )
        self.last_time = Gauge(
            "uploader_last_promoted_timestamp_seconds",
            "Unix time that step's COMMITTED object was written",
            labels,
            registry=self.registry,
        )
        self.age = Gauge(
            "uploader_last_promoted_age_seconds",
            "Seconds since the newest promotion (at scrape time)",
            labels,
            registry=self.registry,
        )
        self.pending = Gauge(
            "uploader_pending_steps",
            "Committed staging steps not yet in the object store",
            labels,
            registry=self.registry,
        )
        self.failures = Counter(
            "uploader_failures",
            "Failed promotion rounds (store) and staging steps that did not verify (verification)",
            [*labels, "reason"],
            registry=self.registry,
        )
        self._last: float | None = None
        self.age.labels(run_id).set_function(lambda: time.time() - self._last if self._last is not None else 0.0)
        for reason in ("store", "verification"):
            self.failures.labels(run_id, reason)  # exported as 0 from the start: increase() sees the first

    def promoted(self, step: int, when: float) -> None:
        if self._last is not None and when < self._last:
            return
        self._last = when
        self.last_step.labels(self.run_id).set(step)
        self.last_time.labels(self.run_id).set(when)

    def failed(self, reason: str) -> None:
        self.failures.labels(self.run_id, reason).inc()

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:  # noqa: S104 (a pod's metrics port)
        start_http_server(port, addr=addr, registry=self.registry)


@dataclass
class Uploader:
    remote: RemoteTier
    staging: PosixTier
    identity: str
    uploaded: list[UploadResult] = field(default_factory=list)
    metrics: UploaderMetrics | None = None
    _cleaned: bool = False

    def _note_store_state(self) -> None:
        """Seed the metrics from the store: its newest committed step and when it was committed."""
        prefix = self.remote.key("steps") + "/"
        commits = [o for o in self.remote.store.list(prefix) if o.key.endswith("/" + COMMITTED_NAME)]
        if self.metrics is not None and commits:
            newest = max(commits, key=lambda o: o.key)  # step names are zero-padded: key order is step order
            step = parse_step_name(newest.key[len(prefix) :].split("/", 1)[0])
            if step is not None:
                self.metrics.promoted(step, newest.mtime or time.time())

    def pending(self) -> list[int]:
        remote = set(self.remote.committed_steps())
        return sorted(s for s in self.staging.committed_steps() if s not in remote)

    def run_once(self) -> list[UploadResult]:
        """Upload every pending step; raises ObjectStoreError if the store is unreachable."""
        self.remote.acquire_lease(self.identity)
        if not self._cleaned:
            aborted = self.remote.store.abort_multipart_uploads(self.remote.base + "/")
            if aborted:
                log.info("aborted %d stale multipart upload(s) of run %s", aborted, self.remote.run_id)
            self._note_store_state()
            self._cleaned = True
        done = []
        pending = self.pending()
        for n, step in enumerate(pending):
            if self.metrics is not None:
                self.metrics.pending.labels(self.remote.run_id).set(len(pending) - n)
            pin = self.staging.pin(step, "upload")
            try:
                result = self.remote.upload_step(self.staging.step_path(step))
            except VerificationError as exc:
                log.error("staging step %d does not verify, not uploading it: %s", step, exc)
                if self.metrics is not None:
                    self.metrics.failed("verification")
                continue
            except FileNotFoundError:
                log.warning("staging step %d disappeared before upload (retention); skipping", step)
                continue
            finally:
                pin.release()
            log.info(
                "promoted step %d: %.1f MB in %.2fs (%.0f MB/s)%s",
                step,
                result.bytes / 1e6,
                result.seconds,
                result.bytes / 1e6 / max(result.seconds, 1e-9),
                f", {result.skipped_objects} object(s) already there" if result.skipped_objects else "",
            )
            done.append(result)
            if self.metrics is not None:
                self.metrics.promoted(step, time.time())
        if self.metrics is not None:
            self.metrics.pending.labels(self.remote.run_id).set(len(pending) - len(done))
        self.uploaded += done
        return done

    def watch(self, poll_s: float, backoff: Backoff, stop: object = None, max_seconds: float | None = None) -> None:
        """Poll forever (or until ``stop.is_set()`` / ``max_seconds``), backing off while the store is down."""
        t0 = time.monotonic()
        while not (stop is not None and stop.is_set()):  # type: ignore[attr-defined]
            delay = poll_s
            try:
                self.run_once()
                backoff.reset()
            except LeaseError:
                raise  # another identity owns the run: retrying cannot help
            except (ObjectStoreError, CheckpointError) as exc:
                if self.metrics is not None:
                    self.metrics.failed("store")
                delay = backoff.next_delay()
                pending = self.staging.committed_steps()
                log.error(
                    "upload failed (%s); retrying in %.2fs; staging steps pending: %s", exc, delay, sorted(pending)
                )
            if max_seconds is not None and time.monotonic() - t0 + delay > max_seconds:
                return
            time.sleep(delay)

"""Schema of ``checkpoint``: every tier (local, replication, reshardable, S3), background saves,
integrity, and what a failed save does. Pure data and its own checks: no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pretrain.config.fail import Fail, positive
from tiering.remote.objectstore import split_uri


@dataclass
class LocalTierConfig:
    """Tier 1: frequent per-rank saves to node-local storage (same topology to load)."""

    dir: str = "runs/ckpt-local"  # node-local storage (NVMe); steps under <dir>/<run.id>/
    interval: int = 10  # steps between saves
    keep: int = 3  # newest verified steps kept per rank (at least 2)
    enabled: bool = True  # save and restore tiers 1-2
    # Seconds a tier-1 save (write, commit, replication) or the start-of-attempt probe may take
    # before the tier's storage counts as stalled (skipped, reported, probed until it answers).
    # None: max(60, 10 x the slowest tier-1 save of this attempt).
    stall_timeout_s: float | None = None
    probe_interval_s: float = 30.0  # while stalled: seconds between probes (each in its own process)

    def check(self, fail: Fail) -> None:
        positive(fail, interval=self.interval)
        if self.keep < 2:
            # With one step kept, a save that commits on some ranks and fails on others leaves
            # no step that every rank has.
            fail("keep", f"must be >= 2, got {self.keep}", "keep at least 2 tier-1 steps")
        check_stall_settings(fail, self.stall_timeout_s, self.probe_interval_s)


def check_stall_settings(fail: Fail, stall_timeout_s: float | None, probe_interval_s: float) -> None:
    """A tier's stall deadline and probe interval (tier 1 and the reshardable tier have both)."""
    if stall_timeout_s is not None and stall_timeout_s <= 0:
        fail("stall_timeout_s", "must be > 0", "give seconds, or leave it unset for the measured default")
    if probe_interval_s <= 0:
        fail("probe_interval_s", "must be > 0", "give seconds between probes of a stalled tier")


@dataclass
class ReplicationConfig:
    """Tier 2: each local step copied to peers in other failure domains."""

    factor: int = 2  # copies of each rank's step, its own included; 1 disables replication
    domains: dict[str, str] = field(default_factory=dict)  # node name -> failure domain
    allow_same_domain: bool = False  # single-node development only
    node: str | None = None  # this rank's node name (default: NODE_NAME, SLURMD_NODENAME, hostname)
    timeout_s: float = 60.0  # bound on every replication transfer

    def check(self, fail: Fail) -> None:
        positive(fail, factor=self.factor)
        if self.timeout_s <= 0:
            fail("timeout_s", "must be > 0", "give a bound in seconds")


@dataclass
class ReshardableTierConfig:
    """Megatron distributed checkpoints (fully reshardable) on shared storage or S3 staging."""

    dir: str = "runs/ckpt-reshardable"  # shared storage or the S3 staging directory; steps under <dir>/<run.id>/
    interval: int = 50  # steps between saves (the last step is always saved)
    keep: int = 2  # newest verified steps kept
    enabled: bool = True  # save and restore this tier
    # Seconds a background save's write or the start-of-attempt probe may take before the shared
    # storage counts as stalled (the tier is skipped by saves and restores, reported, and probed
    # until it answers). None: max(60, 10 x the slowest save of this tier in this attempt).
    stall_timeout_s: float | None = None
    probe_interval_s: float = 30.0  # while stalled: seconds between probes (each in its own process)

    def check(self, fail: Fail) -> None:
        positive(fail, interval=self.interval, keep=self.keep)
        check_stall_settings(fail, self.stall_timeout_s, self.probe_interval_s)


@dataclass
class S3TierConfig:
    """Tier 3: reshardable steps promoted to an object store by ``pretrain upload`` (``tiering upload``)."""

    uri: str | None = None  # s3://bucket/prefix, or file:///path (the same protocol, no server)
    endpoint_url: str | None = None  # S3-compatible stores (Ceph RGW, MinIO, ...)
    interval: int | None = None  # steps between promotions (default: checkpoint.reshardable.interval)
    keep: int = 3  # newest verified steps GC keeps
    milestone_every: int = 0  # also keep every step divisible by this (0: none)
    # GC deletes a step it marked only once the mark is this old (a restore or an upload that read
    # the step's listing before the mark still finds it); 0: on the next pass.
    gc_min_age_s: float = 3600.0
    concurrency: int = 8  # parallel requests of an upload or restore
    multipart_chunk_mb: int = 64  # multipart upload part size (S3's minimum: 5)
    checksum_header: bool = False  # also send x-amz-checksum-sha256 (AWS S3; Ceph RGW ignores it)
    owner: str | None = None  # lease identity (default: RP_RUN_OWNER, else user@host)
    poll_s: float = 5.0  # uploader --watch polling period
    retry_max_s: float = 60.0  # uploader backoff cap when the store is unreachable
    connect_timeout_s: float = 5.0  # S3 client: seconds to wait for a connection before a try fails
    # S3 client: seconds to wait for each read (or write) on a connection before a try fails; a
    # store that stops answering holds each try this long
    read_timeout_s: float = 60.0
    max_attempts: int = 5  # uploader's and GC's S3 client: tries per request, the first included, then their backoff

    def check(self, fail: Fail) -> None:
        if self.uri is None:
            return  # the tier is off: its numbers are unused
        try:
            split_uri(self.uri)
        except ValueError as exc:
            fail("uri", str(exc), "use s3://bucket/prefix or file:///absolute/path")
        if self.gc_min_age_s < 0:
            fail("gc_min_age_s", f"must be >= 0, got {self.gc_min_age_s}", "use the default 3600 (0: the next pass)")
        if self.interval is not None and self.interval < 1:
            fail("interval", "must be >= 1", "set a positive interval")
        if self.keep < 1 or self.concurrency < 1 or self.multipart_chunk_mb < 5:
            fail(
                "keep",
                "keep and concurrency must be >= 1, multipart_chunk_mb >= 5 (S3's minimum)",
                "fix the S3 tier numbers",
            )
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0 or self.max_attempts < 1:
            fail(
                "read_timeout_s",
                "connect_timeout_s and read_timeout_s must be > 0, max_attempts >= 1",
                "set positive timeouts (seconds) and at least one attempt",
            )


@dataclass
class AsyncSaveConfig:
    """Background saves (YAML key ``checkpoint.async``) of tier 1 and of the reshardable staging
    tier that feeds S3: training pays for a snapshot, the step commits once it is durable."""

    enabled: bool = True  # background saves (False: every save blocks training)
    # thread: the writer thread copies the state into reusable host buffers (pinned on GPU)
    # while the next forward/backward runs, then writes; fork: copy-on-write snapshot by
    # os.fork (CPU only: forking a CUDA process is unsafe); auto: fork on CPU (a write stuck in a
    # stalled file system is then its own process, never a thread that keeps the rank from
    # exiting), thread on GPU and when in-process restarts keep the writer's copy.
    mode: Literal["auto", "fork", "thread"] = "auto"
    max_in_flight: int = 1  # per tier
    # A save due while one is in flight: wait for it, or skip this one (logged and counted).
    when_busy: Literal["wait", "skip"] = "wait"

    def check(self, fail: Fail) -> None:
        if self.max_in_flight != 1:
            fail(
                "max_in_flight",
                f"{self.max_in_flight} is not supported",
                "use 1 (one tier-1 save in flight; a second one would double the snapshot memory)",
            )


@dataclass
class IntegrityConfig:
    """How checkpoint bytes are hashed (manifest format v2: one digest per chunk of every file)."""

    # Tiers 1-2 (node-local saves and peer replicas): xxh3-128 detects bit rot, torn and wrong
    # copies at ~10 GB/s per core; blake3 is cryptographic (~2.3 GB/s per core). The reshardable
    # tier, which is what S3 receives, always uses blake3.
    local_hash: Literal["xxh3-128", "blake3", "sha256"] = "xxh3-128"
    chunk_mb: int = 16  # chunk size of the digests (measured: docs/checkpoints.md, "Checkpoint I/O")
    # Threads a writer may use to hash while it writes (and a commit to hash what no writer did):
    # the bound on the CPU a save takes from the ranks. Restores verify on every core.
    hash_threads: int = 2
    # The run's secret (32+ bytes, mode 0600, owned by the user) that tags every transfer between
    # ranks (replicas, tier-0 peer copies, peer restores): a sender without it is refused. The
    # environment variable PRETRAIN_RUN_KEY_FILE overrides it. None: <run.dir>/<run.id>/run.key,
    # created by rank 0 when absent (the run directory is shared by every node).
    run_key_file: str | None = None

    def check(self, fail: Fail) -> None:
        positive(fail, chunk_mb=self.chunk_mb, hash_threads=self.hash_threads)
        if self.chunk_mb > 1024:
            # A replica travels in pieces of whole chunks through a few buffers of that size.
            fail("chunk_mb", f"must be <= 1024, got {self.chunk_mb}", "use the default 16 (4-64 measured)")

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_mb * 1024 * 1024


@dataclass
class MemoryTierConfig:
    """Tier 0 (YAML key ``checkpoint.memory``): each rank's newest state in a memory-backed file
    (tmpfs), written every ``interval`` steps into one of ``slots`` alternating slots, so a rank
    killed at any step loses at most ``interval`` steps and restores without reading a disk.
    It survives the rank process and an ft_launcher restart, not the node (docs/memory-tier.md)."""

    # auto: on when the node's tmpfs (and the job's memory cgroup) holds slots x (own + peer) state
    # for every rank of the node, else off with one line naming the sizes; true: refuse to start
    # without that room; false: off.
    enabled: bool | Literal["auto"] = "auto"
    interval: int = 1  # steps between tier-0 snapshots (1: every step, at most one step lost)
    dir: str = "/dev/shm/resilient-pretrain"  # a tmpfs: Docker --shm-size, Kubernetes emptyDir medium: Memory
    slots: int = 2  # the newest sealed slot is never the one being written

    def check(self, fail: Fail) -> None:
        positive(fail, interval=self.interval)
        if self.slots < 2:
            fail("slots", f"must be >= 2, got {self.slots}", "use 2 (a slot being written is not loadable)")


@dataclass
class AgentConfig:
    """The node's checkpoint agent (YAML key ``checkpoint.agent``): with tier 0 on, tier 1 is
    persisted by one agent process per run per node from the sealed tier-0 slots, so no tier-1
    storage call runs in a training process after its restore (docs/checkpoints.md, "The agent")."""

    enabled: bool = False  # tier 1 through the agent (needs checkpoint.memory.enabled)
    timeout_s: float = 2.0  # a rank's request to the agent: past it the agent counts as gone
    idle_exit_s: float = 60.0  # the agent exits once no rank was connected and nothing queued this long

    def check(self, fail: Fail) -> None:
        if self.timeout_s <= 0 or self.idle_exit_s <= 0:
            fail("timeout_s", "timeout_s and idle_exit_s must be > 0", "use the defaults (2 and 60)")


@dataclass
class CheckpointConfig:
    local: LocalTierConfig = field(default_factory=LocalTierConfig)
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)
    reshardable: ReshardableTierConfig = field(default_factory=ReshardableTierConfig)
    s3: S3TierConfig = field(default_factory=S3TierConfig)
    async_: AsyncSaveConfig = field(default_factory=AsyncSaveConfig)  # YAML: async
    integrity: IntegrityConfig = field(default_factory=IntegrityConfig)
    memory: MemoryTierConfig = field(default_factory=MemoryTierConfig)  # tier 0
    agent: AgentConfig = field(default_factory=AgentConfig)  # tier 1 persisted by the node's agent
    # A save that fails (writer died, disk full, ...): log it and train on, or stop the job.
    on_save_error: Literal["continue", "stop"] = "continue"
    load: bool = True  # restore on start (False: always start from step 0)
    # With no step that every rank can obtain, a run that has committed steps somewhere (own copies,
    # replicas, the reshardable tier, S3) refuses to start from step 0 unless this is true.
    allow_fresh_start: bool = False

    def check(self, fail: Fail) -> None:
        self.local.check(fail.within("local"))
        self.replication.check(fail.within("replication"))
        self.reshardable.check(fail.within("reshardable"))
        self.s3.check(fail.within("s3"))
        self.async_.check(fail.within("async"))
        self.integrity.check(fail.within("integrity"))
        self.memory.check(fail.within("memory"))
        self.agent.check(fail.within("agent"))
        if self.agent.enabled and self.local.enabled:
            if self.memory.enabled is False:
                fail("agent.enabled", "the agent persists tier 0's snapshots, but tier 0 is off",
                     "set checkpoint.memory.enabled=auto or checkpoint.agent.enabled=false")  # fmt: skip
            elif self.local.interval % self.memory.interval:
                fail("agent.enabled", f"tier 1's interval {self.local.interval} is not a multiple of tier 0's "
                     f"{self.memory.interval}: the agent persists steps tier 0 holds",
                     "make checkpoint.local.interval a multiple of checkpoint.memory.interval")  # fmt: skip
        if self.s3.uri is not None and not self.reshardable.enabled:
            fail(
                "s3.uri",
                "the S3 tier promotes reshardable steps, but that tier is disabled",
                "enable checkpoint.reshardable (it is the staging area)",
            )
        if not self.local.enabled and not self.reshardable.enabled:
            fail("local.enabled", "every checkpoint tier is disabled", "enable the local or reshardable tier")

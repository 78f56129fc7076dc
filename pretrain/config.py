"""Typed training configuration: YAML -> dataclasses, validated section by section.

Every error is a :class:`ConfigError` whose message is one line naming the source file, the
dotted key and the fix: ``"{source}: {key}: {problem}; fix: {fix}"``. :func:`load_config` rejects
unknown keys and wrong types. Each section dataclass checks its own fields in ``check(fail)``,
where ``fail`` (:class:`Fail`) is scoped to the section's dotted path, so a nested section such
as ``checkpoint.async`` names its keys in full without knowing where it sits. :func:`validate`
runs every section's check, then the rules that span sections or depend on the launch (world
size, CUDA), before any process group exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NoReturn, Union

import yaml

from pretrain.data.tokenizer_files import tokenizer_vocab_size
from pretrain.errors import ConfigError
from pretrain.resilience.phases import parse_holds
from pretrain.resilience.preemption import parse_signals
from tiering.objectstore import split_uri
from tiering.remote import default_owner


@dataclass(frozen=True)
class Fail:
    """Raises the one-line :class:`ConfigError` for a key of one section.

    ``fail(key, problem, fix)`` names ``{path}.{key}``; ``within(name)`` scopes it to a child
    section; an empty key names the section itself.
    """

    source: str
    path: str = ""

    def __call__(self, key: str, problem: str, fix: str) -> NoReturn:
        full = ".".join(part for part in (self.path, key) if part)
        raise ConfigError(f"{self.source}: {full}: {problem}; fix: {fix}")

    def within(self, name: str) -> Fail:
        return Fail(self.source, f"{self.path}.{name}" if self.path else name)


def _positive(fail: Fail, **values: int) -> None:
    for key, value in values.items():
        if value < 1:
            fail(key, f"must be >= 1, got {value}", "set a positive value")


@dataclass
class RunConfig:
    id: str = "tiny-run"  # the run's name: directories, manifests and S3 keys are under it
    dir: str = "runs"  # where <id>/ holds metrics.jsonl, events.jsonl, attempts/ and ranks/

    def check(self, fail: Fail) -> None:
        if not self.id or "/" in self.id or self.id.startswith("."):
            fail("id", f"{self.id!r} is not a valid run id", "use letters, digits, '-', '_' and '.' only")


@dataclass
class ModelConfig:
    num_layers: int = 2  # transformer layers
    hidden_size: int = 128  # model width
    num_attention_heads: int = 4  # must divide hidden_size
    num_query_groups: int | None = None  # grouped-query attention groups (None: one per head)
    ffn_hidden_size: int | None = None  # MLP width (None: Megatron's default, 4 x hidden_size)
    seq_length: int = 128  # tokens per sample
    # None: the tokenizer's vocabulary (byte: 257); a set value must not be smaller than it.
    vocab_size: int | None = None
    make_vocab_size_divisible_by: int = 128  # the vocabulary is padded up to a multiple of this
    hidden_dropout: float = 0.1  # dropout probability after attention and MLP
    attention_dropout: float = 0.1  # dropout probability of the attention weights
    position_embedding: Literal["rope", "learned_absolute"] = "rope"  # rotary or learned absolute positions
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"  # layer norm kind
    swiglu: bool = False  # SwiGLU MLP instead of GeLU
    untie_embeddings: bool = False  # a separate output layer instead of the input embedding's weights
    init_method_std: float = 0.02  # standard deviation of the weight initialisation
    # auto: Transformer Engine layers when TE and CUDA are present, else Megatron's local spec.
    spec: Literal["auto", "local", "te"] = "auto"
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16 needs CUDA

    def check(self, fail: Fail) -> None:
        _positive(
            fail,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            seq_length=self.seq_length,
            make_vocab_size_divisible_by=self.make_vocab_size_divisible_by,
        )
        if self.vocab_size is not None:
            _positive(fail, vocab_size=self.vocab_size)
        if self.hidden_size % self.num_attention_heads:
            fail(
                "num_attention_heads",
                f"{self.num_attention_heads} does not divide model.hidden_size={self.hidden_size}",
                "pick heads that divide the hidden size",
            )
        for key, value in (("hidden_dropout", self.hidden_dropout), ("attention_dropout", self.attention_dropout)):
            if not 0.0 <= value < 1.0:
                fail(key, f"{value} is outside [0, 1)", "use a probability")


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size
    sequence_parallel: bool = False  # Megatron sequence parallelism (with tp > 1)
    # auto: Megatron's DistributedOptimizer on CUDA, a torch AdamW over DDP main_grad on CPU.
    distributed_optimizer: Literal["auto", "on", "off"] = "auto"

    def check(self, fail: Fail) -> None:
        _positive(fail, tp=self.tp, pp=self.pp)


@dataclass
class BlendPart:
    """One dataset of a blend: a prepared ``prefix`` (``.bin``/``.idx``) and its weight."""

    prefix: str = ""  # a prepared dataset (PREFIX.bin, PREFIX.idx)
    weight: float = 1.0  # its share of the samples (normalised over the blend)


@dataclass
class DataConfig:
    prefix: str = "runs/data/corpus"  # a prepared Megatron indexed dataset (PREFIX.bin, PREFIX.idx)
    # byte: no file; huggingface: a local tokenizer.json (or a directory holding one);
    # sentencepiece: a local .model. Read offline from tokenizer_path.
    tokenizer: Literal["byte", "huggingface", "sentencepiece"] = "byte"
    tokenizer_path: str | None = None  # the tokenizer file (none for byte)
    global_batch_size: int = 8  # samples per step over all data-parallel ranks
    micro_batch_size: int = 2  # samples per forward/backward on one rank
    cache_dir: str | None = None  # where Megatron caches the dataset's sample index (None: beside the data)
    # Several prefixes with weights ([{prefix: ..., weight: ...}, ...]); when set, ``prefix`` is unused.
    blend: list[BlendPart] = field(default_factory=list)
    # Megatron's train,valid,test split of each prefix (weights, normalised): "98,2,0" holds out 2 %
    # for validation. The default keeps everything for training.
    split: str = "100,0,0"
    # Record every rank's consumed sample positions (data-audit/rank-N.jsonl) for exactness checks.
    audit: bool = False

    def check(self, fail: Fail) -> None:
        _positive(fail, global_batch_size=self.global_batch_size, micro_batch_size=self.micro_batch_size)
        for i, part in enumerate(self.blend):
            if not part.prefix or part.weight < 0:
                fail(f"blend[{i}]", "needs a prefix and a weight >= 0", "write {prefix: PATH, weight: W}")
        if self.blend and sum(p.weight for p in self.blend) <= 0:
            fail("blend", "every weight is zero", "give at least one dataset a positive weight")
        parts = self.split.replace("/", ",").split(",")
        try:
            weights = [float(p) for p in parts]
        except ValueError:
            weights = []
        if len(weights) != 3 or min(weights) < 0 or sum(weights) <= 0:
            fail("split", f"{self.split!r} is not three non-negative weights", "write train,valid,test, e.g. 98,2,0")
        if self.tokenizer == "byte" and self.tokenizer_path:
            fail("tokenizer_path", "the byte tokenizer reads no file", "remove it, or set data.tokenizer to its kind")
        if self.tokenizer != "byte" and not self.tokenizer_path:
            fail(
                "tokenizer_path",
                f"data.tokenizer={self.tokenizer} needs a local tokenizer file",
                "set it to a tokenizer.json (huggingface) or a .model (sentencepiece)",
            )

    def prefixes(self) -> list[tuple[str, float]]:
        """(prefix, weight) of every dataset trained on: the blend, or ``prefix`` alone."""
        return [(p.prefix, p.weight) for p in self.blend if p.weight > 0] or [(self.prefix, 1.0)]

    def split_weights(self) -> list[float]:
        weights = [float(p) for p in self.split.replace("/", ",").split(",")]
        return [w / sum(weights) for w in weights]


@dataclass
class OptimizerConfig:
    name: Literal["adamw"] = "adamw"  # the only optimizer
    lr: float = 3.0e-4  # peak learning rate
    min_lr: float = 3.0e-5  # learning rate at the end of the decay
    weight_decay: float = 0.1  # AdamW weight decay
    adam_beta1: float = 0.9  # Adam's first-moment decay
    adam_beta2: float = 0.95  # Adam's second-moment decay
    adam_eps: float = 1.0e-8  # Adam's epsilon
    clip_grad: float = 1.0  # gradient-norm clipping (0: off)

    def check(self, fail: Fail) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            fail("min_lr", f"need 0 <= min_lr <= lr, got lr={self.lr} min_lr={self.min_lr}", "fix the learning rates")
        if self.clip_grad < 0:
            fail("clip_grad", "must be >= 0", "use 0 to disable clipping")


@dataclass
class ScheduleConfig:
    warmup_steps: int = 10  # linear warm-up from 0 to lr
    decay_steps: int | None = None  # steps of the decay to min_lr (None: train.steps)
    decay_style: Literal["constant", "linear", "cosine"] = "cosine"  # learning-rate decay after the warm-up

    def check(self, fail: Fail) -> None:
        if self.warmup_steps < 0:
            fail("warmup_steps", "must be >= 0", "use 0 for no warmup")


@dataclass
class TrainConfig:
    steps: int = 60  # the step training ends at
    seed: int = 1234  # seed of every random stream (model init, dropout, data order)
    log_interval: int = 10  # rank 0 logs loss, grad norm, LR and tokens/s every this many steps

    def check(self, fail: Fail) -> None:
        _positive(fail, steps=self.steps, log_interval=self.log_interval)


@dataclass
class LocalTierConfig:
    """Tier 1: frequent per-rank saves to node-local storage (same topology to load)."""

    dir: str = "runs/ckpt-local"  # node-local storage (NVMe); steps under <dir>/<run.id>/
    interval: int = 10  # steps between saves
    keep: int = 3  # newest verified steps kept per rank
    enabled: bool = True  # save and restore tiers 1-2

    def check(self, fail: Fail) -> None:
        _positive(fail, interval=self.interval, keep=self.keep)


@dataclass
class ReplicationConfig:
    """Tier 2: each local step copied to peers in other failure domains."""

    factor: int = 2  # copies of each rank's step, its own included; 1 disables replication
    domains: dict[str, str] = field(default_factory=dict)  # node name -> failure domain
    allow_same_domain: bool = False  # single-node development only
    node: str | None = None  # this rank's node name (default: NODE_NAME, SLURMD_NODENAME, hostname)
    timeout_s: float = 60.0  # bound on every replication transfer

    def check(self, fail: Fail) -> None:
        _positive(fail, factor=self.factor)
        if self.timeout_s <= 0:
            fail("timeout_s", "must be > 0", "give a bound in seconds")


@dataclass
class ReshardableTierConfig:
    """Megatron distributed checkpoints (fully reshardable) on shared storage or S3 staging."""

    dir: str = "runs/ckpt-reshardable"  # shared storage or the S3 staging directory; steps under <dir>/<run.id>/
    interval: int = 50  # steps between saves (the last step is always saved)
    keep: int = 2  # newest verified steps kept
    enabled: bool = True  # save and restore this tier

    def check(self, fail: Fail) -> None:
        _positive(fail, interval=self.interval, keep=self.keep)


@dataclass
class S3TierConfig:
    """Tier 3: reshardable steps promoted to an object store by ``pretrain upload`` (``tiering upload``)."""

    uri: str | None = None  # s3://bucket/prefix, or file:///path (the same protocol, no server)
    endpoint_url: str | None = None  # S3-compatible stores (Ceph RGW, MinIO, ...)
    interval: int | None = None  # steps between promotions (default: checkpoint.reshardable.interval)
    keep: int = 3  # newest verified steps GC keeps
    milestone_every: int = 0  # also keep every step divisible by this (0: none)
    concurrency: int = 8  # parallel requests of an upload or restore
    multipart_chunk_mb: int = 64  # multipart upload part size (S3's minimum: 5)
    checksum_header: bool = False  # also send x-amz-checksum-sha256 (AWS S3; Ceph RGW ignores it)
    owner: str | None = None  # lease identity (default: RP_RUN_OWNER, else user@host)
    poll_s: float = 5.0  # uploader --watch polling period
    retry_max_s: float = 60.0  # uploader backoff cap when the store is unreachable

    def check(self, fail: Fail) -> None:
        if self.uri is None:
            return  # the tier is off: its numbers are unused
        try:
            split_uri(self.uri)
        except ValueError as exc:
            fail("uri", str(exc), "use s3://bucket/prefix or file:///absolute/path")
        if self.interval is not None and self.interval < 1:
            fail("interval", "must be >= 1", "set a positive interval")
        if self.keep < 1 or self.concurrency < 1 or self.multipart_chunk_mb < 5:
            fail(
                "keep",
                "keep and concurrency must be >= 1, multipart_chunk_mb >= 5 (S3's minimum)",
                "fix the S3 tier numbers",
            )


@dataclass
class AsyncSaveConfig:
    """Background saves (YAML key ``checkpoint.async``) of tier 1 and of the reshardable staging
    tier that feeds S3: training pays for a snapshot, the step commits once it is durable."""

    enabled: bool = True  # background saves (False: every save blocks training)
    # thread: the writer thread copies the state into reusable host buffers (pinned on GPU)
    # while the next forward/backward runs, then writes; fork: copy-on-write snapshot by
    # os.fork (CPU only: forking a CUDA process is unsafe); auto: thread.
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

    def check(self, fail: Fail) -> None:
        _positive(fail, chunk_mb=self.chunk_mb, hash_threads=self.hash_threads)
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

    enabled: bool = False  # tier 0 on (opt-in: it needs slots x state size of tmpfs per rank)
    interval: int = 1  # steps between tier-0 snapshots (1: every step, at most one step lost)
    dir: str = "/dev/shm/resilient-pretrain"  # a tmpfs: Docker --shm-size, Kubernetes emptyDir medium: Memory
    slots: int = 2  # the newest sealed slot is never the one being written

    def check(self, fail: Fail) -> None:
        _positive(fail, interval=self.interval)
        if self.slots < 2:
            fail("slots", f"must be >= 2, got {self.slots}", "use 2 (a slot being written is not loadable)")


@dataclass
class CheckpointConfig:
    local: LocalTierConfig = field(default_factory=LocalTierConfig)
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)
    reshardable: ReshardableTierConfig = field(default_factory=ReshardableTierConfig)
    s3: S3TierConfig = field(default_factory=S3TierConfig)
    async_: AsyncSaveConfig = field(default_factory=AsyncSaveConfig)  # YAML: async
    integrity: IntegrityConfig = field(default_factory=IntegrityConfig)
    memory: MemoryTierConfig = field(default_factory=MemoryTierConfig)  # tier 0
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
        if self.s3.uri is not None and not self.reshardable.enabled:
            fail(
                "s3.uri",
                "the S3 tier promotes reshardable steps, but that tier is disabled",
                "enable checkpoint.reshardable (it is the staging area)",
            )
        if not self.local.enabled and not self.reshardable.enabled:
            fail("local.enabled", "every checkpoint tier is disabled", "enable the local or reshardable tier")


@dataclass
class FaultInjectionConfig:
    """Deliberate faults for drills and tests; active on the launcher's first attempt only."""

    kill_rank: int = -1  # SIGKILL this rank at kill_at_step (-1: none)
    kill_at_step: int = -1  # the step of kill_rank/kill_node/kill_during_replication_rank
    kill_node: str | None = None  # SIGKILL every rank on this node at kill_at_step
    # SIGKILL this rank while it receives a replica at kill_at_step (a peer dying mid-replication)
    kill_during_replication_rank: int = -1
    # This rank stops making progress (a hang) at hang_at_step; ft_launcher's heartbeat timeout must catch it
    hang_rank: int = -1
    hang_at_step: int = -1  # the step hang_rank stops at
    # Apply kill_*/hang_* on every attempt, not just the launcher's first (a fault that repeats).
    every_attempt: bool = False
    # Make the save at this step take this many extra seconds (a slow filesystem), inside the
    # checkpointing section: it must not trip the step timeout.
    slow_save_at_step: int = -1
    slow_save_seconds: float = 0.0  # the extra seconds of that save
    # hang_rank hangs in native code (libc pause()) instead of a Python sleep loop.
    hang_native: bool = False
    # The background writer of the tier-1 save at this step: "fail" (an I/O error: reported, training
    # goes on), "hang" (until killed), "slow" or "bug" (a TypeError: a programming error fails the attempt).
    writer_fault_at_step: int = -1
    writer_fault: str | None = None  # fail, hang, slow or bug
    writer_fault_rank: int = 0  # the rank whose writer is faulted
    # Raise a (user-code) RuntimeError at raise_at_step: on every rank and every attempt (a
    # deterministic bug), or only on raise_rank in the first attempt (a transient fault).
    raise_rank: int = -1
    raise_at_step: int = -1  # the step of that RuntimeError (-1: none)
    # After restoring this step, overwrite a weight with NaN (a checkpoint that verifies but is poisoned).
    poison_restored_step: int = -1
    # Hold every rank for hold_seconds when it enters a phase of an attempt ("RESTART:PHASE", comma
    # separated, RESTART = the launcher's restart count): a window wide enough for a fault injected
    # from outside the job (tests, drills) to land inside that phase. Phases: pretrain.resilience.phases.PHASES.
    hold_at: str | None = None
    hold_seconds: float = 0.0  # how long hold_at holds the ranks
    # The uploader's S3 client (pretrain upload): kill_after_parts=N (SIGKILL after N multipart
    # parts) or timeout_parts=N (the first N parts time out and are retried).
    s3_fault: str | None = None

    def check(self, fail: Fail) -> None:
        try:
            parse_holds(self.hold_at)
        except ValueError as exc:
            fail("hold_at", str(exc), "write RESTART:PHASE pairs, e.g. 1:verify,2:load")


@dataclass
class InprocessConfig:
    """NVRx in-process restart: a fault re-runs training in the same processes (seconds)."""

    enabled: bool = False  # wrap training in NVRx's inprocess.Wrapper
    store_port: int | None = None  # the Wrapper's TCP store (and +1 for process groups); default MASTER_PORT+2
    keep_host_copy: bool = True  # keep the newest tier-1 step in host memory for a disk-free restore
    monitor_interval: float = 0.1  # seconds between the Wrapper's monitor, heartbeat and progress checks
    last_call_wait: float = 0.1  # seconds to gather other ranks' faults after the first
    soft_timeout: float = 60.0  # no progress for this long: abort and restart in-process
    hard_timeout: float = 90.0  # still stuck: the rank is terminated (the outer launcher restarts it)
    heartbeat_timeout: float = 30.0  # a rank silent for this long is taken for dead
    barrier_timeout: float = 120.0  # bound on the Wrapper's barriers and its store
    # Timeout of every process group of an incarnation, Megatron's included: a backstop only, a
    # fault aborts collectives in flight at once (NCCL abort; gloo: the incarnation's connections
    # are shut down). Keep it above the longest legitimate wait (rank skew around saves).
    collective_timeout: float = 60.0

    def check(self, fail: Fail) -> None:
        ordered = (
            0 < self.monitor_interval < self.soft_timeout < self.hard_timeout < self.barrier_timeout
            and self.heartbeat_timeout < self.barrier_timeout
            and 0 < self.collective_timeout < self.hard_timeout
        )
        if self.enabled and not ordered:
            fail(
                "",
                "timeouts must satisfy monitor_interval < soft_timeout < hard_timeout < barrier_timeout, "
                "heartbeat_timeout < barrier_timeout and 0 < collective_timeout < hard_timeout",
                "order the timeouts",
            )


@dataclass
class StragglerConfig:
    """``fault_tolerance.straggler``: NVRx's straggler detector around the training step
    (pretrain.resilience.stragglers). Every ``report_interval`` steps each rank's comm-free compute
    time is scored against the fastest rank (relative) and its own best (individual); a rank whose
    relative score is below ``threshold`` is reported (log line, ``straggler_score``, events.jsonl)."""

    enabled: bool = True  # time each rank's forward and report the slowest ranks
    report_interval: int = 10  # steps between reports (a collective on every rank)
    threshold: float = 0.7  # relative score (fastest rank = 1.0) below which a rank is slow
    patience: int = 3  # consecutive slow reports before ``action`` applies to the rank's node
    action: str = "report"  # report | restart_without (not implemented yet: refused)

    def check(self, fail: Fail) -> None:
        _positive(fail, report_interval=self.report_interval, patience=self.patience)
        if not 0 < self.threshold <= 1:
            fail("threshold", f"must be in (0, 1], got {self.threshold}", "give a relative score such as 0.7")
        if self.action != "report":
            fail("action", f"{self.action!r} is not supported yet", "use report (restart_without is issue 31 part 2)")


@dataclass
class FaultToleranceConfig:
    # Send NVRx RankMonitorClient heartbeats when launched under ft_launcher.
    enabled: bool = True
    # Signals that mean "save and leave": SIGTERM (Kubernetes, ft_launcher shutdown), SIGUSR1 (Slurm --signal).
    preemption_signals: str = "SIGTERM,SIGUSR1"
    # Seconds from the signal to a published emergency tier-1 step; past it the rank exits without one.
    # Keep it below the grace period (terminationGracePeriodSeconds, Slurm KillWait, --workers-stop-timeout).
    emergency_save_timeout: float = 30.0
    # Stop the job (attempts/STOP.json) after this many attempts in a row that failed without
    # committing a step newer than the one they restored.
    max_consecutive_failures_without_progress: int = 3
    # Steps after which ft_launcher's heartbeat/section timeouts are measured and set (then saved
    # in checkpoints); 0 keeps the configured ones.
    calculate_timeouts_after: int = 50
    # A NaN/Inf loss or grad norm fails the step; within this many steps after a restore it marks
    # the restored step as poisoned: quarantined everywhere, the next restore uses an older one.
    check_finite: bool = True
    poison_window: int = 20  # steps after a restore in which a non-finite loss poisons the step
    inprocess: InprocessConfig = field(default_factory=InprocessConfig)
    inject: FaultInjectionConfig = field(default_factory=FaultInjectionConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)

    def check(self, fail: Fail) -> None:
        if self.max_consecutive_failures_without_progress < 1 or self.poison_window < 0:
            fail(
                "max_consecutive_failures_without_progress",
                "must be >= 1 (and poison_window >= 0)",
                "give a positive number of attempts",
            )
        self.inprocess.check(fail.within("inprocess"))
        if self.emergency_save_timeout <= 0:
            fail("emergency_save_timeout", "must be > 0", "give the seconds the grace period allows")
        try:
            parse_signals(self.preemption_signals)
        except ValueError as exc:
            fail("preemption_signals", str(exc), "use names like SIGTERM,SIGUSR1")
        self.inject.check(fail.within("inject"))
        self.straggler.check(fail.within("straggler"))


@dataclass
class MetricsConfig:
    """Prometheus exporter of rank 0 (``/metrics``); a busy port only warns, never stops training."""

    enabled: bool = True  # serve /metrics from rank 0
    host: str = "0.0.0.0"  # address the exporter listens on
    port: int = 9400  # its TCP port

    def check(self, fail: Fail) -> None:
        if not 0 < self.port < 65536:
            fail("port", f"{self.port} is not a TCP port", "use 1-65535 (or metrics.enabled: false)")


@dataclass
class EvalConfig:
    """Validation loss on the valid split every ``interval`` steps (0: never), over ``iters`` global
    batches. It draws no training randomness: a run with evaluation resumes bit-exactly."""

    interval: int = 0  # steps between validation runs (0: never)
    iters: int = 2  # global batches of the valid split per validation run

    def check(self, fail: Fail) -> None:
        if self.interval < 0 or self.iters < 1:
            fail("interval", "interval must be >= 0 and iters >= 1", "e.g. eval.interval: 200, eval.iters: 10")


@dataclass
class LoggingConfig:
    """Where rank 0 also writes TensorBoard scalars (Megatron-LM's tags); None: TensorBoard off."""

    tensorboard_dir: str | None = None  # TensorBoard event files of rank 0 (None: off)

    def check(self, fail: Fail) -> None:
        pass


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    source: str = field(default="<defaults>", metadata={"internal": True})

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("source")
        out["checkpoint"]["async"] = out["checkpoint"].pop("async_")
        return out

    def check(self, fail: Fail) -> None:
        """Every section's own rules (no rule here spans two sections; :func:`validate` has those)."""
        self.run.check(fail.within("run"))
        self.model.check(fail.within("model"))
        self.parallel.check(fail.within("parallel"))
        self.data.check(fail.within("data"))
        self.optimizer.check(fail.within("optimizer"))
        self.schedule.check(fail.within("schedule"))
        self.train.check(fail.within("train"))
        self.checkpoint.check(fail.within("checkpoint"))
        self.fault_tolerance.check(fail.within("fault_tolerance"))
        self.metrics.check(fail.within("metrics"))
        self.eval.check(fail.within("eval"))
        self.logging.check(fail.within("logging"))


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load ``path`` (YAML) and apply ``key.sub=value`` overrides; raise ConfigError on any issue."""
    source = str(path) if path is not None else "<defaults>"
    data: Any = {}
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(
                f"{source}: cannot read config ({exc.strerror}); fix: pass an existing YAML file"
            ) from exc
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{source}:{where}: not valid YAML; fix: correct the syntax") from exc
        if not isinstance(data, dict):
            raise ConfigError(
                f"{source}: top level must be a mapping of sections; fix: start with 'run:', 'model:', ..."
            )
    for item in overrides:
        _apply_override(data, item, source)
    cfg = _build(Config, data, "", source)
    cfg.source = source
    return cfg


def _apply_override(data: dict[str, Any], item: str, source: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE; fix: e.g. --set train.steps=200")
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: --set {key}: '{part}' is not a section; fix: override a leaf key")
        node = child
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""


def _build(cls: type, data: Any, prefix: str, source: str) -> Any:
    where = prefix.rstrip(".") or "<top>"
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: {where}: expected a mapping, got {type(data).__name__}; fix: write it as 'key: value' lines"
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    # Python keywords are spelled with a trailing underscore in the dataclass (checkpoint.async).
    data = {(f"{k}_" if f"{k}_" in fields and k not in fields else k): v for k, v in data.items()}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"did you mean '{prefix}{close[0]}'?" if close else f"valid keys: {', '.join(fields)}"
            raise ConfigError(f"{source}: unknown key '{prefix}{key}'; fix: remove it ({hint})")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, f"{prefix}{name}", source)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, key: str, source: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value if value is not None else {}, key + ".", source)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, key, source)
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and {"on", "off"} <= set(choices):
            value = "on" if value else "off"  # YAML 1.1 reads a bare on/off as a boolean
        if value not in choices:
            raise ConfigError(
                f"{source}: {key}={value!r} is not allowed; fix: use one of {', '.join(map(str, choices))}"
            )
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {key} must be a list; fix: write '- item' entries (or [a, b] inline)")
        (item,) = typing.get_args(tp)
        return [_coerce(item, v, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key} must be a mapping; fix: write 'key: value' entries")
        return {str(k): str(v) for k, v in value.items()}
    return _coerce_scalar(tp, value, key, source)


# The YAML types each scalar field accepts (a bool is never a number: YAML's true is not 1).
_SCALARS: dict[type, tuple[type, ...]] = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}


def _coerce_scalar(tp: Any, value: Any, key: str, source: str) -> Any:
    if tp not in _SCALARS:  # pragma: no cover - a field type this loader does not know is a programming error
        raise TypeError(f"unsupported config field type {tp!r} for {key}")
    if isinstance(value, _SCALARS[tp]) and (tp is bool or not isinstance(value, bool)):
        return float(value) if tp is float else value
    raise ConfigError(
        f"{source}: {key}={value!r} has type {type(value).__name__}, expected {tp.__name__}; fix: give a {tp.__name__}"
    )


# ---------------------------------------------------------------------------------------------
# Validation


def validate(cfg: Config, world_size: int, cuda: bool) -> None:
    """Check every section, then the rules across sections and the launch; raise ConfigError naming the key."""
    fail = Fail(cfg.source)
    cfg.check(fail)  # first: the rules below divide by the sizes it checks
    _check_topology(cfg, world_size, fail)
    s = cfg.schedule
    decay = s.decay_steps if s.decay_steps is not None else cfg.train.steps
    if decay <= s.warmup_steps and s.decay_style != "constant":
        fail(
            "schedule.decay_steps",
            f"{decay} must exceed schedule.warmup_steps={s.warmup_steps}",
            "raise decay_steps (or train.steps) above the warmup",
        )
    if not cuda:
        _check_cpu_only(cfg, fail)
    # After the CPU rules, so that on CPU the fix named is "set it to false", not "raise tp".
    if cfg.parallel.sequence_parallel and cfg.parallel.tp == 1:
        fail("parallel.sequence_parallel", "needs tp > 1", "enable tensor parallelism or disable it")
    if cfg.checkpoint.async_.mode == "fork" and cuda:
        fail("checkpoint.async.mode", "fork is unsafe in a CUDA process", "use thread (or auto)")
    if cfg.eval.interval and cfg.data.split_weights()[1] == 0:
        fail(
            "data.split",
            f"{cfg.data.split!r} leaves the valid split empty while eval.interval={cfg.eval.interval}",
            "give the valid split a weight (e.g. data.split: 98,2,0) or set eval.interval: 0",
        )
    inj = cfg.fault_tolerance.inject
    if inj.kill_rank >= world_size:
        fail(
            "fault_tolerance.inject.kill_rank",
            f"rank {inj.kill_rank} >= world size {world_size}",
            "pick an existing rank or -1",
        )


def fitting_node_counts(cfg: Config, nproc_per_node: int, up_to: int) -> list[int]:
    """Node counts from 1 to ``up_to`` whose world size (nodes x ``nproc_per_node``) the parallel
    layout and the global batch divide (what :func:`validate` checks per world size)."""
    vocab = padded_vocab_size(cfg)  # outside the loop: a tokenizer problem is not a node count's
    fits = []
    for nodes in range(1, up_to + 1):
        try:
            _check_topology(cfg, nodes * nproc_per_node, Fail(cfg.source), vocab)
        except ConfigError:
            continue
        fits.append(nodes)
    return fits


def check_world_size(cfg: Config, nnodes: int, nproc_per_node: int) -> None:
    """Before any node starts (``pretrain launch``): refuse a node count the layout cannot divide,
    e.g. a scale-down to 5 of 6 nodes, with one line naming the node counts that work. Only the
    topology rules are judged here: any other problem (a missing tokenizer file, say) is raised
    as itself, never dressed up as a node count that does not fit."""
    vocab = padded_vocab_size(cfg)
    try:
        _check_topology(cfg, nnodes * nproc_per_node, Fail(cfg.source), vocab)
    except ConfigError as exc:
        problem = str(exc).split("; fix:", 1)[0]
        fits = fitting_node_counts(cfg, nproc_per_node, max(8, 2 * nnodes))
        sizes = ", ".join(f"{n} ({n * nproc_per_node} ranks)" for n in fits) or "none up to " + str(2 * nnodes)
        raise ConfigError(
            f"{nnodes} node(s) x {nproc_per_node} rank(s) = world size {nnodes * nproc_per_node} does not fit "
            f"this layout: {problem}; fix: launch with a node count that fits: {sizes}"
        ) from exc


def _check_topology(cfg: Config, world_size: int, fail: Fail, padded_vocab: int | None = None) -> None:
    """The model, the batch and the world size split over tp x pp x dp (``padded_vocab``: already
    resolved by the caller; reading the tokenizer is not a topology rule)."""
    m, p, d = cfg.model, cfg.parallel, cfg.data
    vocab = padded_vocab if padded_vocab is not None else padded_vocab_size(cfg)
    if m.num_attention_heads % p.tp:
        fail(
            "parallel.tp",
            f"tp={p.tp} does not divide model.num_attention_heads={m.num_attention_heads}",
            "choose a tp that divides the number of heads",
        )
    groups = m.num_query_groups or m.num_attention_heads
    if m.num_attention_heads % groups or groups % p.tp:
        fail(
            "model.num_query_groups",
            f"{groups} groups do not fit {m.num_attention_heads} heads at tp={p.tp}",
            "use groups dividing the heads and divisible by tp",
        )
    if m.num_layers % p.pp:
        fail(
            "parallel.pp", f"pp={p.pp} does not divide model.num_layers={m.num_layers}", "choose pp dividing the layers"
        )
    if world_size % (p.tp * p.pp):
        fail(
            "parallel.tp",
            f"world size {world_size} is not divisible by tp*pp={p.tp * p.pp}",
            "launch a multiple of tp*pp ranks or change tp/pp",
        )
    if vocab % p.tp:
        fail(
            "model.make_vocab_size_divisible_by",
            f"padded vocab {vocab} is not divisible by tp={p.tp}",
            "use a multiple of 128 (divisible by every tp you will use)",
        )
    dp = data_parallel_size(cfg, world_size)
    if d.global_batch_size % (d.micro_batch_size * dp):
        fail(
            "data.global_batch_size",
            f"{d.global_batch_size} is not divisible by micro_batch_size*dp={d.micro_batch_size}*{dp}",
            "make the global batch a multiple of micro_batch_size*dp",
        )


def _check_cpu_only(cfg: Config, fail: Fail) -> None:
    """What a launch without CUDA cannot do."""
    m, p = cfg.model, cfg.parallel
    if m.spec == "te":
        fail("model.spec", "Transformer Engine layers need CUDA, none found", "use spec: auto or local on CPU")
    if m.precision == "bf16":
        fail("model.precision", "bf16 training needs CUDA here", "use precision: fp32 on CPU")
    if p.sequence_parallel:
        fail("parallel.sequence_parallel", "needs TE/Apex norms (CUDA)", "set it to false on CPU")
    if p.pp > 1 and not m.untie_embeddings:
        fail(
            "model.untie_embeddings",
            "tied embeddings across pipeline stages need CUDA (Megatron moves them with .cuda())",
            "set model.untie_embeddings: true for pp > 1 on CPU",
        )
    if p.distributed_optimizer == "on":
        fail(
            "parallel.distributed_optimizer",
            "Megatron's DistributedOptimizer is CUDA-only",
            "use auto or off on CPU",
        )


def s3_owner(cfg: Config) -> str:
    """The identity that may write this run's S3 prefix."""
    return cfg.checkpoint.s3.owner or default_owner()


def data_parallel_size(cfg: Config, world_size: int) -> int:
    return world_size // (cfg.parallel.tp * cfg.parallel.pp)


def padded_vocab_size(cfg: Config) -> int:
    """Vocabulary padded to ``make_vocab_size_divisible_by``.

    Unlike Megatron-LM we do not multiply the multiple by TP: the padded size must not depend on
    the topology, or a checkpoint saved at TP=2 would not load at TP=1. :func:`validate` checks
    that TP divides the result.
    """
    multiple = cfg.model.make_vocab_size_divisible_by
    return -(-resolve_vocab_size(cfg) // multiple) * multiple


def resolve_vocab_size(cfg: Config) -> int:
    """``model.vocab_size`` if set, else the tokenizer's vocabulary (byte: 257); never smaller than it.

    Reads the tokenizer file (offline, cached); its problems are one-line ConfigErrors naming the file.
    """
    try:
        tokenizer_size = tokenizer_vocab_size(cfg.data.tokenizer, cfg.data.tokenizer_path)
    except ConfigError as exc:
        raise ConfigError(f"{cfg.source}: data.tokenizer_path: {exc}") from None
    size = cfg.model.vocab_size
    if size is None:
        return tokenizer_size
    if size < tokenizer_size:
        Fail(cfg.source)(
            "model.vocab_size",
            f"{size} is smaller than the {cfg.data.tokenizer} tokenizer's vocabulary of {tokenizer_size}",
            f"remove it (it is derived from the tokenizer) or set it >= {tokenizer_size}",
        )
    return size

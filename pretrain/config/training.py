"""Schema of the run's identity and loop: ``run``, ``optimizer``, ``schedule``, ``train``, ``logging``,
``metrics``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pretrain.config.fail import Fail, positive


@dataclass
class RunConfig:
    id: str = "tiny-run"  # the run's name: directories, manifests and S3 keys are under it
    dir: str = "runs"  # where <id>/ holds metrics.jsonl, events.jsonl, attempts/ and ranks/

    def check(self, fail: Fail) -> None:
        if not self.id or "/" in self.id or self.id.startswith("."):
            fail("id", f"{self.id!r} is not a valid run id", "use letters, digits, '-', '_' and '.' only")


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
        positive(fail, steps=self.steps, log_interval=self.log_interval)


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
class LoggingConfig:
    """Where rank 0 also writes TensorBoard scalars (Megatron-LM's tags); None: TensorBoard off."""

    tensorboard_dir: str | None = None  # TensorBoard event files of rank 0 (None: off)

    def check(self, fail: Fail) -> None:
        pass

"""The whole configuration: one dataclass per YAML section, checked section by section."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pretrain.config.checkpoint import (
    CheckpointConfig,
)
from pretrain.config.data import DataConfig, EvalConfig
from pretrain.config.fail import Fail
from pretrain.config.fault_tolerance import FaultToleranceConfig
from pretrain.config.model import ModelConfig, ParallelConfig
from pretrain.config.training import (
    LoggingConfig,
    MetricsConfig,
    OptimizerConfig,
    RunConfig,
    ScheduleConfig,
    TrainConfig,
)
from tiering.remote.lease import default_owner


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


def s3_owner(cfg: Config) -> str:
    """The identity that may write this run's S3 prefix."""
    return cfg.checkpoint.s3.owner or default_owner()

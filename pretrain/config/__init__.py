"""Typed training configuration: YAML -> dataclasses, validated section by section.

Every error is a :class:`~pretrain.errors.ConfigError` whose message is one line naming the source
file, the dotted key and the fix: ``"{source}: {key}: {problem}; fix: {fix}"``. The package is
split by concern:

* :mod:`.fail`: the one-line error, scoped to a section;
* :mod:`.training`, :mod:`.model`, :mod:`.data`, :mod:`.checkpoint`, :mod:`.fault_tolerance`: one
  schema per section, each dataclass checking its own fields (``check(fail)``);
* :mod:`.root`: :class:`Config`, the sections together;
* :mod:`.loader`: YAML and ``--set`` overrides into the dataclasses (unknown keys, wrong types);
* :mod:`.topology`: the rules that depend on the world size (``pretrain launch`` asks only these);
* :mod:`.validation`: everything checked before a process group exists.

Import from here (``from pretrain.config import Config, load_config``): the modules are the layout.
"""

from __future__ import annotations

from pretrain.config.checkpoint import (
    AsyncSaveConfig,
    CheckpointConfig,
    IntegrityConfig,
    LocalTierConfig,
    MemoryTierConfig,
    ReplicationConfig,
    ReshardableTierConfig,
    S3TierConfig,
)
from pretrain.config.data import BlendPart, DataConfig, EvalConfig
from pretrain.config.fail import Fail
from pretrain.config.fault_tolerance import FaultInjectionConfig, FaultToleranceConfig, InprocessConfig, StragglerConfig
from pretrain.config.loader import load_config
from pretrain.config.model import ModelConfig, ParallelConfig
from pretrain.config.root import Config, s3_owner
from pretrain.config.topology import (
    check_room_to_exclude,
    check_world_size,
    data_parallel_size,
    fitting_node_counts,
    padded_vocab_size,
    resolve_vocab_size,
)
from pretrain.config.training import (
    LoggingConfig,
    MetricsConfig,
    OptimizerConfig,
    RunConfig,
    ScheduleConfig,
    TrainConfig,
)
from pretrain.config.validation import validate

__all__ = [
    "AsyncSaveConfig",
    "BlendPart",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "EvalConfig",
    "Fail",
    "FaultInjectionConfig",
    "FaultToleranceConfig",
    "InprocessConfig",
    "IntegrityConfig",
    "LocalTierConfig",
    "LoggingConfig",
    "MemoryTierConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "ReplicationConfig",
    "ReshardableTierConfig",
    "RunConfig",
    "S3TierConfig",
    "ScheduleConfig",
    "StragglerConfig",
    "TrainConfig",
    "check_room_to_exclude",
    "check_world_size",
    "data_parallel_size",
    "fitting_node_counts",
    "load_config",
    "padded_vocab_size",
    "resolve_vocab_size",
    "s3_owner",
    "validate",
]

"""Typed configuration for rl_replay: the schema (:mod:`~rl_replay.config.schema`, the dataclasses a
user reads) and its loader (:mod:`~rl_replay.config.loader`: YAML, overrides, validation).

Precedence when loading: dataclass defaults < YAML file < command-line overrides::

    cfg = load_config("configs/memory_gru.yaml", ["optim.lr=3e-4", "env.kwargs.delay=32"])
"""

from rl_replay.config.loader import (
    config_from_dict,
    config_to_dict,
    dump_config,
    load_config,
    loads_config,
    type_name,
    validate,
)
from rl_replay.config.schema import (
    ALGORITHM_NAMES,
    AgentConfig,
    CheckpointConfig,
    CollectorConfig,
    Config,
    DistributedConfig,
    EnvConfig,
    EvalConfig,
    LogConfig,
    LossConfig,
    OptimConfig,
    PPOConfig,
    ReplayConfig,
    batch_size_per_rank,
    num_updates,
)

__all__ = [
    "dump_config",
    "loads_config",
    "ALGORITHM_NAMES",
    "AgentConfig",
    "CheckpointConfig",
    "CollectorConfig",
    "Config",
    "DistributedConfig",
    "EnvConfig",
    "EvalConfig",
    "LogConfig",
    "LossConfig",
    "OptimConfig",
    "PPOConfig",
    "ReplayConfig",
    "batch_size_per_rank",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "num_updates",
    "type_name",
    "validate",
]

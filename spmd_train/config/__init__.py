"""Run configuration: the schema (frozen dataclasses) and the YAML loader with presets and overrides."""

from spmd_train.config.load import config_from_dict, load_config, parse_overrides
from spmd_train.config.mesh_schema import MESH_AXES, AxisFactors, MeshConfig, ParallelConfig, RulesConfig
from spmd_train.config.model_schema import ModelConfig
from spmd_train.config.run_schema import CheckpointConfig, RunConfig
from spmd_train.config.schema import Config
from spmd_train.config.train_schema import DataConfig, OptimConfig, TrainConfig

__all__ = [
    "MESH_AXES",
    "AxisFactors",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "MeshConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RulesConfig",
    "RunConfig",
    "TrainConfig",
    "config_from_dict",
    "load_config",
    "parse_overrides",
]

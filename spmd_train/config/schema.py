"""The run-config schema: `Config`, one frozen dataclass per section.

These dataclasses are the single source of truth for config keys, types and defaults; the sections
live in `model_schema`, `mesh_schema`, `train_schema`, `precision_schema`, `offload_schema` and `run_schema`, the
value types they share in `field_types`. They import nothing from jax so the CLI can read a config (and
`run.simulate_devices`) before jax initialises. Validation is done by `spmd_train.config.load`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spmd_train.config.field_types import STRICT
from spmd_train.config.mesh_schema import MeshConfig, ParallelConfig
from spmd_train.config.model_schema import BackendsConfig, ModelConfig
from spmd_train.config.offload_schema import OffloadConfig
from spmd_train.config.precision_schema import PrecisionConfig
from spmd_train.config.run_schema import CheckpointConfig, RunConfig
from spmd_train.config.train_schema import DataConfig, OptimConfig, TrainConfig


@dataclass(frozen=True)
class Config:
    """A complete run configuration."""

    __pydantic_config__ = STRICT

    model: ModelConfig = field(default_factory=ModelConfig)
    backends: BackendsConfig = field(default_factory=BackendsConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)

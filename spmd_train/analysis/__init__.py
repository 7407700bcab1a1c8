"""Inspect compiled programs: per-device memory, FLOPs and collectives per mesh axis."""

from spmd_train.analysis.collectives import CollectiveSummary, collectives_of
from spmd_train.analysis.param_rows import ParamRow
from spmd_train.analysis.step_report import StepReport, describe
from spmd_train.analysis.topology import tpu_topology_devices
from spmd_train.models.flops import flops_per_token, matmul_params

__all__ = [
    "CollectiveSummary",
    "ParamRow",
    "StepReport",
    "collectives_of",
    "describe",
    "flops_per_token",
    "matmul_params",
    "tpu_topology_devices",
]

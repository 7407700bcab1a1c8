"""The regions that name mesh axes: attention dispatch, expert dispatch, pipelines and their schedules.

Model code calls only the entry points exported here: `attention` (the attention implementation
chosen for the run, kernels wrapped in `shard_map`; `Backends` is that choice, made once by
`resolve_backends` when the engine is built), `moe_ffn` (routed experts, tokens sent to
their experts' devices with `all_to_all`) and `replica_mean` (a statistic averaged over the
replicas of an enclosing gradient region). The pipeline executor and schedules are used by the
train step (`spmd_train.parallel.pipeline`, `spmd_train.parallel.schedules`); the simulator that checks and
measures a schedule is `spmd_train.parallel.schedule_simulator`.
"""

from spmd_train.parallel.attention_dispatch import attention
from spmd_train.parallel.backends import Backends, resolve_backends
from spmd_train.parallel.expert_dispatch import moe_ffn, replica_mean

__all__ = ["Backends", "attention", "moe_ffn", "replica_mean", "resolve_backends"]

"""Pure array math shared by the model, the parallel regions and the tests: no mesh, no config.

`dot_product_attention` (the one XLA grouped-query attention: the model's `xla` path and what
every kernel test compares against), rotary embeddings, MoE routing, the experts' SwiGLU
matmuls and the token cross-entropy.
"""

from spmd_train.ops.attention import dot_product_attention
from spmd_train.ops.capacity import capacity
from spmd_train.ops.experts import ExpertWeights, batched_swiglu, ragged_swiglu
from spmd_train.ops.loss import cross_entropy
from spmd_train.ops.rope import apply_rope, rope_tables
from spmd_train.ops.routing import aux_loss, expert_counts, route, slot_positions, z_loss

__all__ = [
    "ExpertWeights",
    "apply_rope",
    "aux_loss",
    "batched_swiglu",
    "capacity",
    "cross_entropy",
    "dot_product_attention",
    "expert_counts",
    "ragged_swiglu",
    "rope_tables",
    "route",
    "slot_positions",
    "z_loss",
]

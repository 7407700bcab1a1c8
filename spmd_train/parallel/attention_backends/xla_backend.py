"""backends.attention=xla: the reference attention in plain jax (`ops.attention`), which XLA partitions itself."""

from __future__ import annotations

from spmd_train.ops.attention import FULL, dot_product_attention
from spmd_train.parallel.attention_registry import AttentionBackend, Kernel, register_attention
from spmd_train.parallel.backends import Backends


def xla_kernel(backends: Backends) -> Kernel:
    """`ops.dot_product_attention` (keeps the [length, length] scores for the backward)."""
    def xla(q, k, v, seg, causal, lse, scoring=FULL, q_offset=0):
        return dot_product_attention(q, k, v, causal=causal, segment_ids=seg, return_lse=lse, scoring=scoring,
                                     q_offset=q_offset)
    return xla


register_attention(AttentionBackend("xla", xla_kernel, partitioned=True))

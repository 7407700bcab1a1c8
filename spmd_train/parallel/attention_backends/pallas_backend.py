"""backends.attention=pallas: our flash-attention kernels (`kernels.flash_attention`), Mosaic on TPU, Mosaic GPU on
Hopper, interpreted on CPU."""

from __future__ import annotations

from spmd_train.kernels.flash_attention import BlockSizes, flash_attention
from spmd_train.ops.attention import FULL
from spmd_train.parallel.attention_registry import AttentionBackend, Kernel, register_attention
from spmd_train.parallel.backends import Backends


def pallas_kernel(backends: Backends) -> Kernel:
    """The kernels for the run's platform (`Backends.kernels`), block sizes and interpret mode."""
    blocks = BlockSizes(*backends.blocks)

    def pallas(q, k, v, seg, causal, lse, scoring=FULL, q_offset=0):
        return flash_attention(q, k, v, causal=causal, segment_ids=seg, block_sizes=blocks, return_lse=lse,
                               softmax_scale=scoring.scale, window=scoring.window, softcap=scoring.softcap,
                               q_offset=q_offset, interpret=backends.interpret, backend=backends.kernels)
    return pallas


register_attention(AttentionBackend("pallas", pallas_kernel))

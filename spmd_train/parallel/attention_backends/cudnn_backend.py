"""backends.attention=cudnn: cuDNN's fused attention through `jax.nn.dot_product_attention` (NVIDIA GPUs)."""

from __future__ import annotations

import jax

from spmd_train.parallel.attention_registry import AttentionBackend, Kernel, register_attention
from spmd_train.parallel.backends import Backends


def cudnn_kernel(backends: Backends) -> Kernel:
    """cuDNN, causal only and without the log-sum-exp (so not under allgather or ring context parallelism)."""
    def cudnn(q, k, v, seg, causal, lse):
        if lse or not causal or isinstance(seg, tuple):
            raise ValueError("cuDNN through jax.nn.dot_product_attention returns no log-sum-exp: "
                             "parallel.context_parallel=allgather or ring needs backends.attention="
                             "pallas or xla (or use ulysses)")
        return cudnn_attention(q, k, v, seg)
    return cudnn


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None = None, *,
                    implementation: str = "cudnn") -> jax.Array:
    """cuDNN's fused attention through `jax.nn.dot_product_attention`, causal, documents as a dense mask.

    That API takes no segment ids, so documents become a [b, 1, l, l] boolean mask (memory
    quadratic in length): `backends.attention=auto` picks our Pallas kernels on GPU when
    documents are masked. `implementation="xla"` runs the same call anywhere (for tests).
    """
    mask = None if segments is None else segments[:, None, :, None] == segments[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)


register_attention(AttentionBackend("cudnn", cudnn_kernel))

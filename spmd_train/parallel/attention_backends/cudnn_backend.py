"""backends.attention=cudnn: cuDNN's fused attention through `jax.nn.dot_product_attention` (NVIDIA GPUs)."""

from __future__ import annotations

import jax

from spmd_train.ops.attention import FULL
from spmd_train.parallel.attention_registry import AttentionBackend, Kernel, register_attention
from spmd_train.parallel.backends import Backends


def cudnn_kernel(backends: Backends) -> Kernel:
    """cuDNN, causal only and without the log-sum-exp (so not under allgather or ring context parallelism)."""
    def cudnn(q, k, v, seg, causal, lse, scoring=FULL, q_offset=0):
        if lse or not causal or isinstance(seg, tuple) or q_offset:
            raise ValueError("cuDNN through jax.nn.dot_product_attention returns no log-sum-exp: "
                             "parallel.context_parallel=allgather or ring needs backends.attention="
                             "pallas or xla (or use ulysses)")
        if scoring.softcap is not None:
            raise ValueError(f"cuDNN through jax computes no soft-capped logits; got {scoring} (the config checks "
                             "refuse this: see AttentionFacts.variants)")
        return cudnn_attention(q, k, v, seg, scale=scoring.scale, window=scoring.window)
    return cudnn


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None = None, *,
                    scale: float | None = None, window: int | None = None, implementation: str = "cudnn") -> jax.Array:
    """cuDNN's fused attention through `jax.nn.dot_product_attention`, causal, documents as a dense mask.

    That API takes no segment ids, so documents become a [b, 1, l, l] boolean mask (memory
    quadratic in length): `backends.attention=auto` picks our Pallas kernels on GPU when
    documents are masked. A `window` is its local_window_size (window - 1 keys back, none ahead).
    `implementation="xla"` runs the same call anywhere (for tests).
    """
    mask = None if segments is None else segments[:, None, :, None] == segments[:, None, None, :]
    local = None if window is None else (window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, scale=scale, local_window_size=local,
                                        implementation=implementation)


register_attention(AttentionBackend("cudnn", cudnn_kernel))

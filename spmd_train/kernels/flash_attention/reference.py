"""Plain XLA attention with the kernel's exact semantics: what every kernel test compares against."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def reference_attention(q, k, v, *, causal=True, segment_ids=None, softmax_scale=None, return_lse=False):
    """[b, lq, h, d] x [b, lk, kvh, d] -> [b, lq, h, d] (and lse [b, h, lq]), grouped-query, fp32 softmax.

    `segment_ids` is None, one [b, l] array for both sides, or a (q_segments, kv_segments) pair.
    Rows with no visible key give zeros and a log-sum-exp of -inf.
    """
    b, lq, h, d = q.shape
    lk, kvh = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else d**-0.5
    qg = q.reshape(b, lq, kvh, h // kvh, d)
    s = jnp.einsum("blkgd,bmkd->bkglm", qg, k, preferred_element_type=jnp.float32) * scale
    mask = jnp.ones((lq, lk), bool)
    if causal:
        mask = jnp.arange(lq)[:, None] >= jnp.arange(lk)[None, :]
    mask = jnp.broadcast_to(mask, (b, 1, 1, lq, lk))
    if segment_ids is not None:
        q_seg, kv_seg = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
        mask = mask & (q_seg[:, None, None, :, None] == kv_seg[:, None, None, None, :])
    s = jnp.where(mask, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    out = jnp.einsum("bkglm,bmkd->blkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out.reshape(b, lq, h, d).astype(q.dtype)
    return (out, lse.reshape(b, h, lq)) if return_lse else out

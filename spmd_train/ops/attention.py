"""Plain XLA grouped-query attention: the model's `xla` implementation, and the semantics every
attention kernel must match (what their tests compare against)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dot_product_attention(q, k, v, *, causal=True, segment_ids=None, softmax_scale=None, return_lse=False):
    """[b, lq, h, d] x [b, lk, kvh, d] -> [b, lq, h, d] (and lse [b, h, lq]), grouped-query, fp32 softmax.

    `segment_ids` is None, one [b, l] array for both sides, or a (q_segments, kv_segments) pair.
    Rows with no visible key give zeros and a log-sum-exp of -inf. K/V are never repeated:
    query heads are grouped per K/V head.

    Masked scores get the most negative finite fp32, not -inf, so the softmax and its gradient
    stay finite with nothing extra kept for the backward pass: the model's step holds the same
    residuals as a plain softmax (measured: -inf masking plus an explicit log-sum-exp kept 11%
    more temporary memory in the fsdp config's step).
    """
    b, lq, h, d = q.shape
    lk, kvh = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else d**-0.5
    qg = q.reshape(b, lq, kvh, h // kvh, d)
    s = jnp.einsum("blkgd,bmkd->bkglm", qg, k, preferred_element_type=jnp.float32) * scale
    mask = None
    if causal:
        mask = jnp.arange(lq)[:, None] >= jnp.arange(lk)[None, :]
    if segment_ids is not None:
        q_seg, kv_seg = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
        same = q_seg[:, None, None, :, None] == kv_seg[:, None, None, None, :]
        mask = same if mask is None else mask & same
    if mask is not None:
        s = jnp.where(mask, s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1)
    # A row can see nothing only with segments, or causal with more queries than keys.
    empty_rows = mask is not None and (segment_ids is not None or lq > lk)
    if empty_rows:
        visible = jnp.any(mask, axis=-1, keepdims=True)
        p = jnp.where(visible, p, 0.0)
    out = jnp.einsum("bkglm,bmkd->blkgd", p.astype(v.dtype), v).reshape(b, lq, h, d).astype(q.dtype)
    if not return_lse:
        return out
    lse = jax.nn.logsumexp(s, axis=-1)
    if empty_rows:
        lse = jnp.where(visible[..., 0], lse, -jnp.inf)
    return out, lse.reshape(b, h, lq)

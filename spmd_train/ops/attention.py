"""Plain XLA grouped-query attention: the model's `xla` implementation, and the semantics every
attention kernel must match (what their tests compare against).

Positions: query row i sits at position i + q_offset, key column j at position j. A query sees a key
when they share a document (segment ids), when the key is not in its future (causal), and when the key
is among the `window` latest positions up to the query's own (q_pos - k_pos < window: the query itself
and window - 1 keys before it, as Mistral, Gemma and gpt-oss define their sliding windows).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Scoring:
    """How one attention layer turns q.k into softmax logits, beyond causality and documents (static, hashable)."""

    scale: float | None = None
    """Multiplies q.k; None: head_dim ** -0.5 (Gemma's query_pre_attn_scalar gives 1 / sqrt(that scalar))."""
    softcap: float | None = None
    """Logits become softcap * tanh(logits / softcap) (Gemma 2's attention soft-capping); None: left as they are."""
    window: int | None = None
    """A query sees only keys with q_pos - k_pos < window (a sliding-window layer); None: every earlier key."""

    def __post_init__(self):
        if self.window is not None and self.window < 1:
            raise ValueError(f"window={self.window}: a query must see at least itself (valid: 1 or more, or None)")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap={self.softcap} must be positive (or None)")


FULL = Scoring()
"""Plain scaled dot-product scores: no cap, no window."""


def visible(q_pos, k_pos, *, causal: bool, window: int | None):
    """Whether a query at q_pos sees a key at k_pos (broadcasting int arrays), ignoring documents; None: always."""
    mask = None
    if causal:
        mask = k_pos <= q_pos
    if window is not None:
        near = q_pos - k_pos < window
        mask = near if mask is None else mask & near
    return mask


def dot_product_attention(q, k, v, *, causal=True, segment_ids=None, softmax_scale=None, return_lse=False,
                          scoring: Scoring = FULL, q_offset: int = 0, sinks=None):
    """[b, lq, h, d] x [b, lk, kvh, d] -> [b, lq, h, dv] (and lse [b, h, lq]), grouped-query, fp32 softmax.

    `segment_ids` is None, one [b, l] array for both sides, or a (q_segments, kv_segments) pair.
    `scoring` caps and windows the logits (`Scoring`; its `scale` is overridden by `softmax_scale`);
    `q_offset` places the queries after the keys' start (module docstring). `sinks` [h] (or None):
    each head's learned sink logit, which joins every row's softmax denominator and takes no value
    (gpt-oss); the returned log-sum-exp then includes it. Values may be narrower than queries and keys (MLA).
    Rows with no visible key give zeros and a log-sum-exp of -inf (without sinks). K/V are never repeated:
    query heads are grouped per K/V head.

    Masked scores get the most negative finite fp32, not -inf, so the softmax and its gradient
    stay finite with nothing extra kept for the backward pass: the model's step holds the same
    residuals as a plain softmax (measured: -inf masking plus an explicit log-sum-exp kept 11%
    more temporary memory in the fsdp config's step).
    """
    b, lq, h, d = q.shape
    lk, kvh, dv = k.shape[1], k.shape[2], v.shape[3]
    scale = softmax_scale if softmax_scale is not None else scoring.scale if scoring.scale is not None else d**-0.5
    qg = q.reshape(b, lq, kvh, h // kvh, d)
    s = jnp.einsum("blkgd,bmkd->bkglm", qg, k, preferred_element_type=jnp.float32) * scale
    if scoring.softcap is not None:
        s = scoring.softcap * jnp.tanh(s / scoring.softcap)
    mask = visible((q_offset + jnp.arange(lq))[:, None], jnp.arange(lk)[None, :], causal=causal, window=scoring.window)
    if segment_ids is not None:
        q_seg, kv_seg = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
        same = q_seg[:, None, None, :, None] == kv_seg[:, None, None, None, :]
        mask = same if mask is None else mask & same
    if mask is not None:
        s = jnp.where(mask, s, jnp.finfo(jnp.float32).min)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kvh, h // kvh, 1, 1), (b, kvh, h // kvh, lq, 1))
        p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :lk]
    else:
        p = jax.nn.softmax(s, axis=-1)
    # Without documents, each query sees at least itself unless queries and keys are offset or of unequal lengths.
    empty_rows = mask is not None and (segment_ids is not None or q_offset != 0 or lq > lk)
    if empty_rows:
        seen = jnp.any(mask, axis=-1, keepdims=True)
        p = jnp.where(seen, p, 0.0)
    out = jnp.einsum("bkglm,bmkd->blkgd", p.astype(v.dtype), v).reshape(b, lq, h, dv).astype(q.dtype)
    if not return_lse:
        return out
    lse = jax.nn.logsumexp(s if sinks is None else jnp.concatenate([s, sink], axis=-1), axis=-1)
    if empty_rows and sinks is None:
        lse = jnp.where(seen[..., 0], lse, -jnp.inf)
    return out, lse.reshape(b, h, lq)


def with_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array) -> jax.Array:
    """Attention over keys (out [b, lq, h, dv], its log-sum-exp [b, h, lq]) -> the same with each head's sink
    logit (sinks [h]) joining the softmax denominator: out * sum / (sum + e^sink) = out * sigmoid(lse - sink).

    Exact for any way the keys were split (kernels, context-parallel merges): the sink enters once, at the end,
    and its gradient reaches `sinks` and, through `lse`, the scores."""
    weight = jax.nn.sigmoid(lse - sinks.astype(jnp.float32)[None, :, None])  # lse -inf (nothing seen): weight 0
    return (out.astype(jnp.float32) * jnp.swapaxes(weight, 1, 2)[..., None]).astype(out.dtype)

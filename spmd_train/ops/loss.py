"""Token cross-entropy that works on vocabulary-sharded logits without gathering them."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross-entropy in fp32: logits [batch, length, vocab], targets [batch, length].

    `weights` [batch, length] scale each target's loss before the mean (0: not scored).

    Both terms are reductions over the vocabulary axis (a log-sum-exp and a masked sum), so
    with the vocabulary split over devices each device reduces its slice and only [batch,
    length] partial results cross the wire; the target logit is never picked by a gather.
    """
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    target_logit = jnp.sum(jnp.where(vocab_ids == targets[..., None], logits, 0.0), axis=-1)
    losses = lse - target_logit
    return jnp.mean(losses if weights is None else weights * losses)

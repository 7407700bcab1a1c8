"""Attention over blocks of keys, merged exactly: each block's output and log-sum-exp combine into
the output over all of them (the flash-attention recurrence, across devices' blocks).

A merge state is (sum of weighted outputs [b, lq, h, d] fp32, running max of the blocks' lse
[b, h, lq], sum of weights [b, h, lq]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def empty(q):
    """The merge state before any block, for queries like `q`."""
    b, lq, h, d = q.shape
    return (jnp.zeros((b, lq, h, d), jnp.float32), jnp.full((b, h, lq), -jnp.inf, jnp.float32),
            jnp.zeros((b, h, lq), jnp.float32))


def nothing(q):
    """The result of a block no query sees: zero output, log-sum-exp -inf."""
    b, lq, h, d = q.shape
    return jnp.zeros((b, lq, h, d), q.dtype), jnp.full((b, h, lq), -jnp.inf, jnp.float32)


def _rows(w):
    return jnp.swapaxes(w, 1, 2)[..., None]  # [b, h, lq] -> [b, lq, h, 1]


def merge(merged, out, lse):
    """The merge state with one more block's output [b, lq, h, d] and log-sum-exp [b, h, lq]."""
    # Relative to a running maximum that carries no gradient (the result does not depend on it);
    # blocks a row cannot see have lse -inf and weigh exactly 0.
    acc, top, total = merged
    new_top = jax.lax.stop_gradient(jnp.maximum(top, lse))
    ref = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
    rescale, weight = jnp.exp(top - ref), jnp.exp(lse - ref)
    return acc * _rows(rescale) + out.astype(jnp.float32) * _rows(weight), new_top, total * rescale + weight


def finish(merged, dtype):
    """(output, its log-sum-exp) once every block is merged; every query sees at least itself, so total > 0."""
    acc, top, total = merged
    return (acc / _rows(total)).astype(dtype), top + jnp.log(total)

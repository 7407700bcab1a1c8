"""Rotary position embeddings (Llama's rotate-half convention)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_tables(length: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables, [length, head_dim // 2], for rotary position embeddings (fp32)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate [batch, length, heads, head_dim] by position (rotate-half convention, as in Llama)."""
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return out.astype(x.dtype)

"""Rotary position embeddings (Llama's rotate-half convention)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_tables(length: int, head_dim: int, theta: float,
                positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables for rotary position embeddings (fp32): [length, head_dim // 2] for positions
    0 .. length - 1, or [batch, length, head_dim // 2] for given per-token `positions` [batch, length]."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    pos = jnp.arange(length, dtype=jnp.float32) if positions is None else positions.astype(jnp.float32)
    angles = pos[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate [batch, length, heads, head_dim] by position (rotate-half convention, as in Llama)."""
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    cos, sin = (cos[None, :, None, :], sin[None, :, None, :]) if cos.ndim == 2 else (cos[:, :, None], sin[:, :, None])
    out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return out.astype(x.dtype)

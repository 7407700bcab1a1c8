"""Rotary position embeddings (Llama's rotate-half convention), with Llama 3.1's, linear and YaRN frequency scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def inverse_frequencies(head_dim: int, theta: float, scaling=None) -> jax.Array:
    """RoPE's per-pair frequencies theta^(-2i/head_dim) [head_dim // 2] in fp32, optionally stretched.

    `scaling` (a `config.model_schema.RopeScaling` or anything with its fields): `linear` divides every
    frequency by `factor`; `llama3` (Llama 3.1, as `transformers` computes it) divides those whose
    wavelength exceeds original_max_position / low_freq_factor, keeps those below
    original_max_position / high_freq_factor, and blends linearly in 1 / wavelength between the two.
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    if scaling.type == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling)
    if scaling.type != "llama3":
        raise ValueError(f"rope scaling {scaling.type!r} is not one of: llama3, linear, yarn")
    original, factor = scaling.original_max_position, scaling.factor
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return jnp.where(medium, blended, scaled)


def _yarn(inv_freq: jax.Array, head_dim: int, theta: float, scaling) -> jax.Array:
    # The dimension pair that turns `rotations` times over the original context, then a ramp between the pairs of
    # beta_fast and beta_slow turns: kept (extrapolated) above it, divided by factor (interpolated) below it.
    def pair(rotations):
        return head_dim * math.log(scaling.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair(scaling.beta_fast), pair(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # transformers' extrapolation factor, blended as it blends (to its last bit)
    return inv_freq / scaling.factor * (1 - kept) + inv_freq * kept


def rope_attention_factor(scaling) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (1 for other scalings and none)."""
    if scaling is None or scaling.type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    if scaling.mscale and scaling.mscale_all_dim:
        return _mscale(scaling.factor, scaling.mscale) / _mscale(scaling.factor, scaling.mscale_all_dim)
    return _mscale(scaling.factor, 1.0)


def yarn_softmax_factor(scaling) -> float:
    """What DeepSeek's MLA multiplies its softmax scale by under YaRN: mscale(mscale_all_dim) squared (1 without it).

    With mscale = mscale_all_dim (DeepSeek-V3: both 1) the tables' attention factor is 1 and this is YaRN's whole
    temperature, on the logits instead of on cos and sin."""
    if scaling is None or scaling.type != "yarn" or not scaling.mscale_all_dim:
        return 1.0
    return _mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def _mscale(factor: float, scale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0


def rope_tables(length: int, head_dim: int, theta: float, positions: jax.Array | None = None, *,
                scaling=None) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables for rotary position embeddings (fp32): [length, head_dim // 2] for positions
    0 .. length - 1, or [batch, length, head_dim // 2] for given per-token `positions` [batch, length].
    `scaling` as in `inverse_frequencies`; YaRN's tables are also multiplied by its attention factor."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    pos = jnp.arange(length, dtype=jnp.float32) if positions is None else positions.astype(jnp.float32)
    angles = pos[..., None] * inv_freq
    factor = rope_attention_factor(scaling)
    if factor == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate [batch, length, heads, head_dim] by position (rotate-half convention, as in Llama)."""
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    cos, sin = (cos[None, :, None, :], sin[None, :, None, :]) if cos.ndim == 2 else (cos[:, :, None], sin[:, :, None])
    out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return out.astype(x.dtype)

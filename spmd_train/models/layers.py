"""Transformer building blocks that are pure functions of arrays: rotary embeddings and attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from spmd_train.sharding.constrain import constrain, stored_param


def param(key: jax.Array, shape: tuple[int, ...], axes: tuple[str, ...], *, std: float | None, dtype,
          stack: int | tuple[int, ...] | None = None) -> nnx.Param:
    """A parameter drawn from N(0, std^2) (ones when std is None), tagged with its logical axes.

    With `stack=L` the parameter gets a leading `layers` axis of size L, one slice per layer;
    with `stack=(G, n)` a `layers` axis of G groups, then a `sublayers` axis of n layers each.
    """
    if stack is not None:
        stack = (stack,) if isinstance(stack, int) else tuple(stack)
        shape, axes = (*stack, *shape), ("layers", *("sublayers",) * (len(stack) - 1), *axes)
    value = jnp.ones(shape, jnp.float32) if std is None else std * jax.random.normal(key, shape, jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=P(*axes))


def weight(p: nnx.Param, dtype) -> jax.Array:
    """A parameter cast to the compute dtype, then laid out for compute.

    The compute layout maps the parameter's logical axes through the activation rules, so
    FSDP shards are gathered (after the cast: bf16 compute gathers bf16) while tensor-parallel
    splits stay.
    """
    return _compute_layout(p[...], _names(p), dtype)


def dense(equation: str, x: jax.Array, p: nnx.Param, dtype) -> jax.Array:
    """`einsum(equation, x, weight(p))`, keeping only the stored (sharded) weight for backward.

    Autodiff would otherwise keep each gathered weight alive from the forward to the backward
    pass, i.e. one whole unsharded copy of the model per device under ZeRO-3. Checkpointing
    the gather with the matmul makes the backward pass gather again instead, as FSDP does;
    the matmul itself is not recomputed (its output is not needed by its own gradient).
    """
    names = _names(p)

    def apply(x, w):
        return jnp.einsum(equation, x, _compute_layout(w, names, dtype))

    return jax.checkpoint(apply, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)(x, p[...])


def _names(p: nnx.Param) -> tuple[str, ...]:
    return tuple(p.get_metadata()["logical_axes"])[-p[...].ndim :]  # inside the layer scan `layers` is sliced off


def _compute_layout(value: jax.Array, names: tuple[str, ...], dtype) -> jax.Array:
    return constrain(stored_param(value, names).astype(dtype), names)


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


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True) -> jax.Array:
    """Plain XLA grouped-query attention: q [b, l, h, d], k/v [b, m, kv, d] -> [b, l, h, d].

    Softmax runs in fp32. K/V are never repeated: query heads are grouped per K/V head.
    """
    b, l, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, l, kv, h // kv, d)
    scores = jnp.einsum("blkgd,bmkd->bkglm", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(d).astype(
        jnp.float32
    )
    if causal:
        mask = jnp.arange(l)[:, None] >= jnp.arange(k.shape[1])[None, :]
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkglm,bmkd->blkgd", probs, v)
    return out.reshape(b, l, h, d)

"""FP8 matmul operands: quantize-dequantize with per-tensor current scaling, e4m3 forward and e5m2 gradients.

A tensor is scaled so its largest magnitude lands on the format's largest finite value (current scaling: the amax of
this very tensor, no history), rounded to the 8-bit format, and multiplied back. XLA's GPU compiler rewrites a dot of
such dequantized operands into an FP8 GEMM (its "qdq" pattern, as Flax's and Transformer Engine's FP8 recipes feed
it); elsewhere the same numbers are computed in the compute dtype, which is what CPU tests check. Forward operands
use e4m3 (3 mantissa bits, range 448), the output gradient e5m2 (2 bits, range 57344): Micikevicius et al. 2022,
"FP8 Formats for Deep Learning". Gradients pass the operands' rounding unchanged (the straight-through estimator).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FORWARD = jnp.float8_e4m3fn
"""The forward operands' format: activations and weights."""
BACKWARD = jnp.float8_e5m2
"""The output gradient's format."""


def scale_of(x: jax.Array, fmt) -> jax.Array:
    """The float32 scale that maps |x|'s largest value onto `fmt`'s largest finite value (1 for an all-zero x); no
    gradient flows through it."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    scale = amax / float(jnp.finfo(fmt).max)
    return jax.lax.stop_gradient(jnp.where(scale > 0, scale, 1.0))


def quantize(x: jax.Array, fmt, scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(x / scale rounded to `fmt`, scale); e4m3fn has no infinity, so values are clipped to its range first."""
    scale = scale_of(x, fmt) if scale is None else scale
    top = float(jnp.finfo(fmt).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(fmt), scale


def dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """`q` times its scale, in `dtype`."""
    return (q.astype(jnp.float32) * scale).astype(dtype)


@jax.custom_vjp
def qdq(x: jax.Array) -> jax.Array:
    """`x` rounded through e4m3 at its own scale, in its dtype; the gradient passes unchanged."""
    return dequantize(*quantize(x, FORWARD), x.dtype)


def _qdq_fwd(x):
    return qdq(x), None


def _qdq_bwd(_, g):
    return (g,)


qdq.defvjp(_qdq_fwd, _qdq_bwd)


@jax.custom_vjp
def grad_qdq(y: jax.Array) -> jax.Array:
    """`y` unchanged; its gradient rounded through e5m2 at the gradient's own scale (the backward matmuls' operand)."""
    return y


def _grad_qdq_fwd(y):
    return y, None


def _grad_qdq_bwd(_, g):
    return (dequantize(*quantize(g, BACKWARD), g.dtype),)


grad_qdq.defvjp(_grad_qdq_fwd, _grad_qdq_bwd)

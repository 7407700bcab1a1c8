"""int8 matmuls, forward and backward: symmetric scales along each operand's kept axes, int32 accumulation.

`einsum(equation, x, w)` computes the einsum as an s8 x s8 -> s32 dot (the instruction TPU v5e and v6e run at twice
their bfloat16 rate) between the two operands rounded to int8, then multiplies back by the outer product of their
scales. Each operand's scales run along the axes it keeps (amax over the axes the dot contracts): per token for an
activation, per output channel for a weight, the scheme AQT uses (Abdolrashidi et al. 2021, "Pareto-Optimal
Quantized ResNet Is Mostly 4-bit"; Google's "Accurate Quantized Training" for TPU v5e). The backward pass is two
more such dots, each operand re-scaled along the axes *that* dot keeps (the output gradient per token for the input
gradient; the input and the output gradient per feature, over the tokens, for the weight gradient), so all three
matmuls of a layer run in int8. Rounding is to nearest; gradients flow as if the rounding were not there (the
straight-through estimator). Exact: int32 holds any sum of up to 2^17 products of two int8 values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from spmd_train.ops.einsum_specs import gradient_equations, operands

LEVELS = 127
"""The largest magnitude an operand is scaled to (symmetric: -128 is not used)."""


def quantize(x: jax.Array, contracted: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """(x rounded to int8, its float32 scale): one scale per index of the axes not in `contracted` (the amax over
    `contracted` mapped onto LEVELS; 1 where that amax is 0), kept as size-1 axes at `contracted`."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=contracted, keepdims=True)
    scale = jax.lax.stop_gradient(jnp.where(amax > 0, amax / LEVELS, 1.0))
    return jnp.clip(jnp.round(x32 / scale), -LEVELS, LEVELS).astype(jnp.int8), scale


def int8_dot(equation: str, a: jax.Array, b: jax.Array, dtype) -> jax.Array:
    """`einsum(equation, a, b)` through int8 operands scaled along their kept axes, in `dtype`; no custom gradient."""
    sa, sb, so = operands(equation)
    gradient_equations(equation)  # refuses an axis summed within one operand alone
    qa, scale_a = quantize(a, tuple(i for i, n in enumerate(sa) if n not in so))
    qb, scale_b = quantize(b, tuple(i for i, n in enumerate(sb) if n not in so))
    acc = jnp.einsum(equation, qa, qb, preferred_element_type=jnp.int32)
    keep_a = "".join(n for n in sa if n in so)
    keep_b = "".join(n for n in sb if n in so)
    # The outer product of the kept scales, laid out as the output (the contracted size-1 axes dropped first).
    scale = jnp.einsum(f"{keep_a},{keep_b}->{so}", _squeeze_contracted(scale_a, sa, so),
                       _squeeze_contracted(scale_b, sb, so))
    return (acc.astype(jnp.float32) * scale).astype(dtype)


def _squeeze_contracted(scale: jax.Array, spec: str, out: str) -> jax.Array:
    return jnp.squeeze(scale, axis=tuple(i for i, n in enumerate(spec) if n not in out))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def einsum(equation: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`jnp.einsum(equation, x, w)` with all three of its matmuls (forward, input and weight gradients) in int8;
    the output in x's dtype, each gradient in its operand's."""
    return int8_dot(equation, x, w, x.dtype)


def _einsum_fwd(equation, x, w):
    return einsum(equation, x, w), (x, w)


def _einsum_bwd(equation, residuals, g):
    x, w = residuals
    dx_equation, dw_equation = gradient_equations(equation)
    return int8_dot(dx_equation, g, w, x.dtype), int8_dot(dw_equation, x, g, w.dtype)


einsum.defvjp(_einsum_fwd, _einsum_bwd)

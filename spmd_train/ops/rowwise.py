"""Matmuls whose operands are rounded to 8 bits at a scale per row: int8 (s8 x s8 -> s32 dots) or FP8 (e4m3 forward,
e5m2 gradients), forward and backward.

`einsum(equation, x, w, fmt)` rounds each operand at scales along the axes it keeps (the amax over the axes the dot
contracts): per token for an activation, per output channel for a weight, the scheme AQT uses for int8 (Abdolrashidi
et al. 2021, "Pareto-Optimal Quantized ResNet Is Mostly 4-bit"; Google's "Accurate Quantized Training" for TPU v5e)
and torchtitan's "rowwise" FP8 recipe. The backward pass is two more such matmuls, each operand re-scaled along the
axes *that* matmul keeps (the output gradient per token for the input gradient; the input and the output gradient
per feature, over the tokens, for the weight gradient), so all three matmuls of a layer are rounded. Rounding is to
nearest; gradients flow as if it were not there (the straight-through estimator).

int8 runs the dot on the rounded integers with int32 accumulation (exact: int32 holds any sum of up to 2^17 products
of two int8 values) and scales the result back in float32: the instruction TPU v5e and v6e run at twice their
bfloat16 rate. FP8 multiplies the rounded values in the compute dtype, which holds every e4m3 and e5m2 value
exactly, with float32 accumulation: the numbers of an FP8 GEMM with row scales, on any backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from spmd_train.ops.einsum_specs import gradient_equations, operands

LEVELS = 127
"""The largest magnitude an int8 operand is scaled to (symmetric: -128 is not used)."""
FORMATS = {"int8": (jnp.int8, jnp.int8), "fp8": (jnp.float8_e4m3fn, jnp.float8_e5m2)}
"""Each format's (forward operands, output gradient) element types."""


def quantize(x: jax.Array, contracted: tuple[int, ...], fmt=jnp.int8) -> tuple[jax.Array, jax.Array]:
    """(x rounded to `fmt`, its float32 scale): one scale per index of the axes not in `contracted` (the amax over
    `contracted` mapped onto the format's largest value, LEVELS for int8; 1 where that amax is 0), kept as size-1
    axes at `contracted`."""
    x32 = x.astype(jnp.float32)
    top = LEVELS if fmt == jnp.int8 else float(jnp.finfo(fmt).max)
    amax = jnp.max(jnp.abs(x32), axis=contracted, keepdims=True)
    scale = jax.lax.stop_gradient(jnp.where(amax > 0, amax / top, 1.0))
    scaled = jnp.clip(x32 / scale, -top, top)  # e4m3fn has no infinity: clip before the cast
    return (jnp.round(scaled) if fmt == jnp.int8 else scaled).astype(fmt), scale


def scaled_dot(equation: str, a: jax.Array, b: jax.Array, dtype, fmt_a=jnp.int8, fmt_b=jnp.int8) -> jax.Array:
    """`einsum(equation, a, b)` through operands rounded to `fmt_a` and `fmt_b` at scales along their kept axes, in
    `dtype`; no custom gradient."""
    sa, sb, so = operands(equation)
    gradient_equations(equation)  # refuses an axis summed within one operand alone
    qa, scale_a = quantize(a, tuple(i for i, n in enumerate(sa) if n not in so), fmt_a)
    qb, scale_b = quantize(b, tuple(i for i, n in enumerate(sb) if n not in so), fmt_b)
    if fmt_a == fmt_b == jnp.int8:
        acc = jnp.einsum(equation, qa, qb, preferred_element_type=jnp.int32).astype(jnp.float32)
    else:
        wide = jnp.bfloat16 if jnp.dtype(dtype).itemsize <= 2 else jnp.float32  # holds e4m3 and e5m2 exactly
        acc = jnp.einsum(equation, qa.astype(wide), qb.astype(wide), preferred_element_type=jnp.float32)
    keep_a = "".join(n for n in sa if n in so)
    keep_b = "".join(n for n in sb if n in so)
    # The outer product of the kept scales, laid out as the output (the contracted size-1 axes dropped first).
    scale = jnp.einsum(f"{keep_a},{keep_b}->{so}", _squeeze_contracted(scale_a, sa, so),
                       _squeeze_contracted(scale_b, sb, so))
    return (acc * scale).astype(dtype)


def _squeeze_contracted(scale: jax.Array, spec: str, out: str) -> jax.Array:
    return jnp.squeeze(scale, axis=tuple(i for i, n in enumerate(spec) if n not in out))


def einsum(equation: str, x: jax.Array, w: jax.Array, fmt: str = "int8") -> jax.Array:
    """`jnp.einsum(equation, x, w)` with all three of its matmuls (forward, input and weight gradients) on operands
    rounded to `fmt` (FORMATS) at row scales; the output in x's dtype, each gradient in its operand's."""
    return _einsum(equation, *same_vma(x, w), fmt)


def same_vma(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """The arrays, each cast to vary over every manual axis any of them varies over (inside a shard_map region).

    A custom gradient must return each cotangent as its operand varies: an activation the same on every device of an
    axis (invariant) meeting a weight split over it gives a gradient that varies there. Made varying before the custom
    rule, the cast's own transpose (a psum over that axis) sums it back, as jnp.einsum's implicit broadcast would."""
    vmas = [_varying(a) for a in arrays]
    union = frozenset().union(*vmas)
    return tuple(a if v == union else jax.lax.pcast(a, tuple(sorted(union - v)), to="varying")
                 for a, v in zip(arrays, vmas, strict=True))


def _varying(a: jax.Array) -> frozenset[str]:
    """The manual axes `a` varies over: jax 0.10 types say it as `manual_axis_type.varying`, earlier ones as `vma`."""
    t = jax.typeof(a)
    manual = getattr(t, "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset(getattr(t, "vma", ()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _einsum(equation: str, x: jax.Array, w: jax.Array, fmt: str) -> jax.Array:
    forward, _ = FORMATS[fmt]
    return scaled_dot(equation, x, w, x.dtype, forward, forward)


def _einsum_fwd(equation, x, w, fmt):
    return _einsum(equation, x, w, fmt), (x, w)


def _einsum_bwd(equation, fmt, residuals, g):
    x, w = residuals
    forward, backward = FORMATS[fmt]
    dx_equation, dw_equation = gradient_equations(equation)
    return (scaled_dot(dx_equation, g, w, x.dtype, backward, forward),
            scaled_dot(dw_equation, x, g, w.dtype, forward, backward))


_einsum.defvjp(_einsum_fwd, _einsum_bwd)

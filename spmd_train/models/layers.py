"""Parameters with logical axes, the matmul that uses a stored (possibly sharded) weight, and RMSNorm."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from spmd_train.config.mesh_schema import STACKING_AXES
from spmd_train.config.model_schema import ModelConfig
from spmd_train.config.precision_schema import takes_quantized
from spmd_train.models.param_specs import norm_params
from spmd_train.ops import rowwise
from spmd_train.ops.einsum_specs import gradient_equations
from spmd_train.ops.fp8 import FORWARD, dequantize, grad_qdq, qdq, quantize
from spmd_train.ops.matmul_mode import matmul_in_use, reduce_in_use
from spmd_train.sharding.constrain import constrain, stored_param


@dataclasses.dataclass(frozen=True)
class Stack:
    """Copies of a layer's parameters stacked on leading axes with these logical names (`param(stack=...)`)."""

    sizes: tuple[int, ...]
    axes: tuple[str, ...]


def in_host_memory(x: jax.Array) -> bool:
    """Whether an array (a traced one too) lives in host memory (offload.params keeps the layer stack there)."""
    return jax.typeof(x).memory_space == jax.memory.Space.Host


def param(key: jax.Array, shape: tuple[int, ...], axes: tuple[str, ...], *, std: float | None, dtype,
          stack: int | tuple[int, ...] | Stack | None = None) -> nnx.Param:
    """A parameter drawn from N(0, std^2) (ones when std is None, zeros when it is 0), tagged with its logical axes.

    With `stack=L` the parameter gets a leading `layers` axis of size L, one slice per layer;
    with `stack=(G, n)` a `layers` axis of G groups, then a `sublayers` axis of n layers each; a `Stack` names its
    own axes.
    """
    if isinstance(stack, Stack):
        shape, axes = (*stack.sizes, *shape), (*stack.axes, *axes)
    elif stack is not None:
        stack = (stack,) if isinstance(stack, int) else tuple(stack)
        shape, axes = (*stack, *shape), (*STACKING_AXES[: len(stack)], *axes)
    if std is None or std == 0:
        value = jnp.full(shape, 1.0 if std is None else 0.0, jnp.float32)
    else:
        value = std * jax.random.normal(key, shape, jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=P(*axes))


@dataclasses.dataclass(frozen=True)
class Pinned:
    """A parameter already pinned to its stored layout (`pin`), for a weight with more than one use."""

    value: jax.Array
    names: tuple[str, ...]


def pin(p: nnx.Param, dtype) -> Pinned:
    """Cast a parameter to the compute dtype and pin it to its stored layout once, for a weight used twice.

    Each `weight`/`dense` of an nnx.Param pins it itself, so the two uses of a tied embedding table
    would each move their own gradient into the shard; through one pin autodiff adds the two
    cotangents first (XLA's partitioner still reduces each use's partial sums where that use is
    partitioned, but the moves after it run once). Cast before the pin: pinned in fp32, the two
    bf16 cotangents are each converted and reduce-scattered (1213 instead of 721 MB for Llama-3.2-1B
    on v6e:4x4 with 2 layers).
    """
    names = _names(p)
    return Pinned(stored_param(p[...].astype(dtype), names), names)


def weight(p: nnx.Param | Pinned, dtype) -> jax.Array:
    """A parameter cast to the compute dtype, then laid out for compute.

    The compute layout maps the parameter's logical axes through the activation rules, so
    FSDP shards are gathered (after the cast: bf16 compute gathers bf16) while tensor-parallel
    splits stay.
    """
    value, names, pinned = _unpack(p)
    return _compute_layout(value, names, dtype, pinned=pinned)


def dense(equation: str, x: jax.Array, p: nnx.Param | Pinned, dtype) -> jax.Array:
    """`einsum(equation, x, weight(p))`, keeping only the stored (sharded) weight for backward.

    Autodiff would otherwise keep each gathered weight alive from the forward to the backward
    pass, i.e. one whole unsharded copy of the model per device under ZeRO-3. Checkpointing
    the gather with the matmul makes the backward pass gather again instead, as FSDP does;
    the matmul itself is not recomputed (its output is not needed by its own gradient).
    """
    value, names, pinned = _unpack(p)
    mode = matmul_in_use() if takes_quantized(names) else "default"

    def apply(x, w):
        if mode == "fp8":  # precision.matmul=fp8 (`use_matmul`): e4m3 operands, the weight gathered in e4m3, e5m2 grads
            return grad_qdq(jnp.einsum(equation, qdq(x), _fp8_compute_layout(w, names, dtype, pinned)))
        reduce = reduce_in_use()
        if mode == "default" and reduce is not None and jnp.dtype(reduce) != jnp.dtype(dtype):
            return _reduced_dense(equation, *rowwise.same_vma(x, w), names, dtype, pinned, reduce)  # precision.reduce
        w = _compute_layout(w, names, dtype, pinned=pinned)
        if mode in ("int8", "fp8-row"):  # s8 dots or FP8 operands, forward and backward, per-token/channel scales
            return rowwise.einsum(equation, x, w, "int8" if mode == "int8" else "fp8")
        return jnp.einsum(equation, x, w)

    return jax.checkpoint(apply, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)(x, value)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4, 5, 6))
def _reduced_dense(equation: str, x: jax.Array, value: jax.Array, names: tuple[str, ...], dtype, pinned: bool,
                   reduce: str) -> jax.Array:
    """`einsum(equation, x, weight)` whose weight gradient comes out of its matmul in `reduce`, so that the sum over
    the batch's devices, which XLA's partitioner puts right after that matmul, runs in `reduce` (converting the
    gradient afterwards would leave the sum in the compute dtype); laid out and cast back as `_compute_layout`'s."""
    return jnp.einsum(equation, x, _compute_layout(value, names, dtype, pinned=pinned))


def _reduced_dense_fwd(equation, x, value, names, dtype, pinned, reduce):
    return _reduced_dense(equation, x, value, names, dtype, pinned, reduce), (x, value)


def _reduced_dense_bwd(equation, names, dtype, pinned, reduce, residuals, g):
    x, value = residuals
    dx_equation, dw_equation = gradient_equations(equation)
    dx = jnp.einsum(dx_equation, g, _compute_layout(value, names, dtype, pinned=pinned))
    dw = constrain(jnp.einsum(dw_equation, x, g, preferred_element_type=jnp.dtype(reduce)), names)
    return dx.astype(x.dtype), (dw if pinned else stored_param(dw, names)).astype(value.dtype)


_reduced_dense.defvjp(_reduced_dense_fwd, _reduced_dense_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _fp8_compute_layout(value: jax.Array, names: tuple[str, ...], dtype, pinned: bool) -> jax.Array:
    """The weight rounded to e4m3 at its own scale while still in its stored shards, laid out for compute (so an FSDP
    gather moves one byte an element), then dequantized to `dtype`; the gradient passes as for `_compute_layout`."""
    stored = value if pinned else stored_param(value, names)
    q, scale = quantize(stored, FORWARD)  # the amax of a sharded weight: one scalar reduced over its shards
    # Gathered as bytes: compilers for chips without FP8 (XLA:CPU, TPU v5) widen an e4m3 gather to float32.
    gathered = constrain(jax.lax.bitcast_convert_type(q, jnp.uint8), names)
    return dequantize(jax.lax.bitcast_convert_type(gathered, FORWARD), scale, dtype)


def _fp8_layout_fwd(value, names, dtype, pinned):
    return _fp8_compute_layout(value, names, dtype, pinned), jnp.zeros((), value.dtype)


def _fp8_layout_bwd(names, dtype, pinned, like, g):
    g = constrain(g, names).astype(like.dtype)
    return (g if pinned else stored_param(g, names),)


_fp8_compute_layout.defvjp(_fp8_layout_fwd, _fp8_layout_bwd)


def _unpack(p: nnx.Param | Pinned) -> tuple[jax.Array, tuple[str, ...], bool]:
    return (p.value, p.names, True) if isinstance(p, Pinned) else (p[...], _names(p), False)


def _names(p: nnx.Param) -> tuple[str, ...]:
    return tuple(p.get_metadata()["logical_axes"])[-p[...].ndim :]  # inside the layer scan `layers` is sliced off


def _compute_layout(value: jax.Array, names: tuple[str, ...], dtype, *, pinned: bool = False) -> jax.Array:
    # Pin, then cast. Casting first would move only the gathers over replica axes and the vocabulary
    # all-to-all into bf16 (XLA reduces the gradient in bf16 either way) and costs about 1 GiB more
    # peak memory for Llama-3-8B at fsdp 64 (10.63 vs 9.66 GiB; docs/describe.md).
    return constrain((value if pinned else stored_param(value, names)).astype(dtype), names)


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis with a learned scale (or 1 + scale: model.norm_plus_one); statistics
    in fp32.

    The residual stream's norms span `embed`; Qwen3's query/key norms span each head's `head_dim`; MLA's latent
    norms span `q_lora` or `kv_lora`.
    """

    def __init__(self, cfg: ModelConfig, *, stack: int | tuple[int, ...] | None = None, axis: str = "embed"):
        self.eps, self.plus_one = cfg.norm_eps, cfg.norm_plus_one
        self.scale = param(None, *norm_params(cfg, axis)["scale"], std=0.0 if self.plus_one else None,
                           dtype=cfg.param_dtype, stack=stack)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = weight(self.scale, jnp.float32)
        # Gemma's (1 + scale) is formed in fp32 and applied before the cast back, as its checkpoints were trained.
        return (normed * (1.0 + scale if self.plus_one else scale)).astype(x.dtype)

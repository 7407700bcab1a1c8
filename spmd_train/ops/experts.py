"""The experts' SwiGLU feed-forward as pure functions of arrays: batched over slots, or ragged.

Expert weights are [E, d, f] (gate, up) and [E, f, d] (down) with the logical axes below, and optionally biases
[E, f] (gate, up) and [E, d] (down) (gpt-oss). The activation is SwiGLU, or gpt-oss's clamped form (`limit`).
They may arrive as stored (possibly FSDP-sharded) arrays: the caller's `Prepare` hook turns
each into its compute form (cast, gathered, laid out) and runs inside the matmul's
checkpoint, so the backward pass gathers again instead of keeping every gathered expert
alive (as `models.layers.dense` does for dense weights). Nothing here knows of meshes.

Under precision.matmul (`ops.matmul_mode.use_matmul`) the batched matmuls run in FP8 (per-tensor or row scales) or
int8 like the dense layers'; the ragged ones in FP8 at per-tensor scales only, int8 and row-scaled FP8 keep the
compute dtype there (`config.precision_schema.quantizes_experts` says the same to the planner). The weights are
gathered in the compute dtype and rounded after.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from spmd_train.ops import rowwise
from spmd_train.ops.einsum_specs import explicit
from spmd_train.ops.fp8 import grad_qdq, qdq
from spmd_train.ops.matmul_mode import matmul_in_use

GATE_UP_AXES = ("experts", "embed", "expert_mlp")
DOWN_AXES = ("experts", "expert_mlp", "embed")
GATE_UP_BIAS_AXES = ("experts", "expert_mlp")
DOWN_BIAS_AXES = ("experts", "embed")
GPT_OSS_ALPHA = 1.702
"""gpt-oss's clamped SwiGLU: the gate's sigmoid is taken at alpha times the gate (github.com/openai/gpt-oss)."""


class ExpertWeights(NamedTuple):
    """The stored expert weights of one MoE layer (or the local experts of one device); biases None when absent."""

    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array
    b_gate: jax.Array | None = None
    b_up: jax.Array | None = None
    b_down: jax.Array | None = None

    def axes(self) -> ExpertWeights:
        """Each field's logical axes (None where the bias is absent): the layout a caller places them by."""
        biased = self.b_gate is not None
        return ExpertWeights(GATE_UP_AXES, GATE_UP_AXES, DOWN_AXES, *((GATE_UP_BIAS_AXES, GATE_UP_BIAS_AXES,
                                                                     DOWN_BIAS_AXES) if biased else ()))


def activate(gate: jax.Array, up: jax.Array, limit: float | None = None) -> jax.Array:
    """SwiGLU's silu(gate) * up; with `limit`, gpt-oss's: gate clamped to at most limit and up to [-limit, limit],
    then (up + 1) * gate * sigmoid(1.702 * gate)."""
    if limit is None:
        return jax.nn.silu(gate) * up
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(GPT_OSS_ALPHA * gate)


class Prepare(NamedTuple):
    """What the caller does around the expert matmuls (layout, gathers, reductions over its devices)."""

    weight: Callable[[jax.Array, tuple[str, ...], object], jax.Array]
    """(stored weight, its logical axes, compute dtype) -> the weight the matmul uses."""
    reduce: Callable[[jax.Array], jax.Array]
    """Sums the down projection's partial outputs where the hidden width is split."""


PLAIN = Prepare(lambda w, names, dtype: w.astype(dtype), lambda y: y)
"""Weights used as they are (cast to the compute dtype), nothing to reduce."""


def _matmul(matmul, x: jax.Array, w: jax.Array, names: tuple[str, ...], dtype, prepare: Prepare) -> jax.Array:
    def apply(x, w):
        return matmul(x, prepare.weight(w, names, dtype))

    out = jax.checkpoint(apply, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)(x, w)
    return prepare.reduce(out) if names == DOWN_AXES else out


def run_of_rows(sizes: jax.Array, rows: int) -> jax.Array:
    """For `rows` rows laid out as consecutive runs of `sizes` [R] rows, each row's run [rows] (R past the last run).

    How many runs end at or before the row: a searchsorted written as a scatter and a cumsum, because jnp's
    searchsorted trips over varying-manual-axis types inside a shard_map region in jax 0.10."""
    return jnp.cumsum(jnp.zeros((rows,), jnp.int32).at[jnp.cumsum(sizes)].add(1, mode="drop"))


def _bias(b: jax.Array | None, names: tuple[str, ...], dtype, prepare: Prepare) -> jax.Array | None:
    return None if b is None else prepare.weight(b, names, dtype)


def _quantized_einsum(mode: str) -> Callable[[str], Callable[[jax.Array, jax.Array], jax.Array]]:
    """equation -> the experts' matmul under `use_matmul`'s mode: the compute dtype's, FP8 at per-tensor scales, or
    FP8 or int8 at row scales (per slot and per expert output channel; `ops.rowwise`)."""
    def einsum(eq):
        if mode == "fp8":
            return lambda a, w: grad_qdq(jnp.einsum(eq, qdq(a), qdq(w)))
        if mode in ("fp8-row", "int8"):
            fmt = "int8" if mode == "int8" else "fp8"
            return lambda a, w: rowwise.einsum(explicit(eq, a.ndim, w.ndim), a, w, fmt)
        return lambda a, w: jnp.einsum(eq, a, w)

    return einsum


def batched_swiglu(x: jax.Array, weights: ExpertWeights, dtype, prepare: Prepare = PLAIN,
                   limit: float | None = None) -> jax.Array:
    """Every expert on its own slots: x [..., E, C, d] -> [..., E, C, d], one batched matmul per weight."""
    x = x.astype(dtype)
    einsum = _quantized_einsum(matmul_in_use())

    def plus(y, b, names):  # a bias [E, n] over every slot [..., E, C, n]
        b = _bias(b, names, dtype, prepare)
        return y if b is None else y + b[:, None, :]

    gate = plus(_matmul(einsum("...ecd,edf->...ecf"), x, weights.w_gate, GATE_UP_AXES, dtype, prepare),
                weights.b_gate, GATE_UP_BIAS_AXES)
    up = plus(_matmul(einsum("...ecd,edf->...ecf"), x, weights.w_up, GATE_UP_AXES, dtype, prepare),
              weights.b_up, GATE_UP_BIAS_AXES)
    out = _matmul(einsum("...ecf,efd->...ecd"), activate(gate, up, limit), weights.w_down, DOWN_AXES, dtype, prepare)
    return plus(out, weights.b_down, DOWN_BIAS_AXES)  # after the reduction over a split hidden width: once


def ragged_swiglu(x: jax.Array, group_sizes: jax.Array, weights: ExpertWeights, dtype,
                  prepare: Prepare = PLAIN, limit: float | None = None) -> jax.Array:
    """Rows sorted by expert: x [M, d] with group_sizes [E] -> [M, d]; rows past sum(group_sizes) give 0."""
    x = x.astype(dtype)

    def ragged(a, w):
        if matmul_in_use() == "fp8":  # per-tensor FP8 is elementwise on the operands; row scales are not built here
            return grad_qdq(jax.lax.ragged_dot(qdq(a), qdq(w), group_sizes))
        return jax.lax.ragged_dot(a, w, group_sizes)

    # Each row's expert, for the biases (only a biased model needs it; padding rows take the last, then are zeroed).
    if weights.b_gate is not None:
        expert = jnp.minimum(run_of_rows(group_sizes, x.shape[0]), group_sizes.shape[0] - 1)

    def plus(y, b, names):
        b = _bias(b, names, dtype, prepare)
        return y if b is None else y + jnp.take(b, expert, axis=0)

    gate = plus(_matmul(ragged, x, weights.w_gate, GATE_UP_AXES, dtype, prepare), weights.b_gate, GATE_UP_BIAS_AXES)
    up = plus(_matmul(ragged, x, weights.w_up, GATE_UP_AXES, dtype, prepare), weights.b_up, GATE_UP_BIAS_AXES)
    out = plus(_matmul(ragged, activate(gate, up, limit), weights.w_down, DOWN_AXES, dtype, prepare),
               weights.b_down, DOWN_BIAS_AXES)
    # Whatever ragged_dot leaves in rows outside every group, padding must contribute nothing.
    valid = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(valid[:, None], out, jnp.zeros_like(out))

"""The experts' SwiGLU feed-forward as pure functions of arrays: batched over slots, or ragged.

Expert weights are [E, d, f] (gate, up) and [E, f, d] (down) with the logical axes below.
They may arrive as stored (possibly FSDP-sharded) arrays: the caller's `Prepare` hook turns
each into its compute form (cast, gathered, laid out) and runs inside the matmul's
checkpoint, so the backward pass gathers again instead of keeping every gathered expert
alive (as `models.layers.dense` does for dense weights). Nothing here knows of meshes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

GATE_UP_AXES = ("experts", "embed", "expert_mlp")
DOWN_AXES = ("experts", "expert_mlp", "embed")


class ExpertWeights(NamedTuple):
    """The stored expert weights of one MoE layer (or the local experts of one device)."""

    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array


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


def batched_swiglu(x: jax.Array, weights: ExpertWeights, dtype, prepare: Prepare = PLAIN) -> jax.Array:
    """Every expert on its own slots: x [..., E, C, d] -> [..., E, C, d], one batched matmul per weight."""
    x = x.astype(dtype)

    def einsum(eq):
        return lambda a, w: jnp.einsum(eq, a, w)

    gate = _matmul(einsum("...ecd,edf->...ecf"), x, weights.w_gate, GATE_UP_AXES, dtype, prepare)
    up = _matmul(einsum("...ecd,edf->...ecf"), x, weights.w_up, GATE_UP_AXES, dtype, prepare)
    return _matmul(einsum("...ecf,efd->...ecd"), jax.nn.silu(gate) * up, weights.w_down, DOWN_AXES, dtype, prepare)


def ragged_swiglu(x: jax.Array, group_sizes: jax.Array, weights: ExpertWeights, dtype,
                  prepare: Prepare = PLAIN) -> jax.Array:
    """Rows sorted by expert: x [M, d] with group_sizes [E] -> [M, d]; rows past sum(group_sizes) give 0."""
    x = x.astype(dtype)

    def ragged(a, w):
        return jax.lax.ragged_dot(a, w, group_sizes)

    gate = _matmul(ragged, x, weights.w_gate, GATE_UP_AXES, dtype, prepare)
    up = _matmul(ragged, x, weights.w_up, GATE_UP_AXES, dtype, prepare)
    out = _matmul(ragged, jax.nn.silu(gate) * up, weights.w_down, DOWN_AXES, dtype, prepare)
    # Whatever ragged_dot leaves in rows outside every group, padding must contribute nothing.
    valid = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(valid[:, None], out, jnp.zeros_like(out))

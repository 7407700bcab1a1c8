"""The experts' SwiGLU feed-forward as pure functions of arrays: batched over slots, or ragged.

Expert weights are [E, d, f] (gate, up) and [E, f, d] (down) with the logical axes below.
They arrive as stored (possibly FSDP-sharded) arrays; each matmul gathers its weight into
the compute layout itself, inside a checkpoint, so the backward pass gathers again instead
of keeping every gathered expert alive (as `layers.dense` does for dense weights).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from spmd_train.sharding.constrain import constrain, stored_param

GATE_UP_AXES = ("experts", "embed", "expert_mlp")
DOWN_AXES = ("experts", "expert_mlp", "embed")


class ExpertWeights(NamedTuple):
    """The stored expert weights of one MoE layer (or the local experts of one device)."""

    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array


class Manual(NamedTuple):
    """What a shard_map region does by hand around the expert matmuls (over its manual axes)."""

    gather: Callable[[jax.Array, tuple[str, ...]], jax.Array]
    """Gathers the region's shard of a weight (given its logical axes) into the compute layout."""
    reduce: Callable[[jax.Array], jax.Array]
    """Sums the down projection's partial outputs over the axes that split the hidden width."""


def _gathered(w: jax.Array, names: tuple[str, ...], dtype, manual: Manual | None) -> jax.Array:
    w = stored_param(w, names).astype(dtype)  # cast first: bf16 compute gathers bf16
    return constrain(manual.gather(w, names) if manual is not None else w, names)


def _matmul(matmul, x: jax.Array, w: jax.Array, names: tuple[str, ...], dtype, manual: Manual | None) -> jax.Array:
    def apply(x, w):
        return matmul(x, _gathered(w, names, dtype, manual))

    out = jax.checkpoint(apply, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)(x, w)
    return manual.reduce(out) if manual is not None and names == DOWN_AXES else out


def batched_swiglu(x: jax.Array, weights: ExpertWeights, dtype, manual: Manual | None = None) -> jax.Array:
    """Every expert on its own slots: x [..., E, C, d] -> [..., E, C, d], one batched matmul per weight."""
    x = x.astype(dtype)

    def einsum(eq):
        return lambda a, w: jnp.einsum(eq, a, w)

    gate = _matmul(einsum("...ecd,edf->...ecf"), x, weights.w_gate, GATE_UP_AXES, dtype, manual)
    up = _matmul(einsum("...ecd,edf->...ecf"), x, weights.w_up, GATE_UP_AXES, dtype, manual)
    return _matmul(einsum("...ecf,efd->...ecd"), jax.nn.silu(gate) * up, weights.w_down, DOWN_AXES, dtype, manual)


def ragged_swiglu(x: jax.Array, group_sizes: jax.Array, weights: ExpertWeights, dtype,
                  manual: Manual | None = None) -> jax.Array:
    """Rows sorted by expert: x [M, d] with group_sizes [E] -> [M, d]; rows past sum(group_sizes) give 0."""
    x = x.astype(dtype)

    def ragged(a, w):
        return jax.lax.ragged_dot(a, w, group_sizes)

    gate = _matmul(ragged, x, weights.w_gate, GATE_UP_AXES, dtype, manual)
    up = _matmul(ragged, x, weights.w_up, GATE_UP_AXES, dtype, manual)
    out = _matmul(ragged, jax.nn.silu(gate) * up, weights.w_down, DOWN_AXES, dtype, manual)
    # Whatever ragged_dot leaves in rows outside every group, padding must contribute nothing.
    valid = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(valid[:, None], out, jnp.zeros_like(out))

"""The constraints that move a stack of matrices to whole matrices on each device and back, for an optimizer that
needs whole matrices (Muon's Newton-Schulz iteration): the steps, and their padding, are `config.matrix_moves`' (the
planner counts their bytes from the same rule)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from spmd_train.config.matrix_moves import Move, whole_matrix_moves
from spmd_train.sharding.arithmetic import entry_axes, spec_entry
from spmd_train.sharding.constrain import active_layout, constrain_to_spec


def spec_of(entries: Sequence[Sequence[str]]) -> P:
    """A layout (`config.matrix_moves.Entries`) as a PartitionSpec."""
    return P(*(spec_entry(e) for e in entries))


def stored_spec(names: Sequence[str | None], shape: Sequence[int]) -> P | None:
    """The optimizer state's layout of an array with these logical axes (split over `fsdp` from ZeRO stage 1) under
    the active layout; None without one."""
    layout = active_layout()
    if layout is None:
        return None
    return layout.param_spec(P(*names), tuple(shape), fsdp=layout.zero_stage >= 1)


def to_whole_matrices(x: jax.Array, names: Sequence[str | None], matrix_dims: Sequence[int]
                      ) -> tuple[jax.Array, tuple[Move, ...]]:
    """`x` (optimizer-state shaped, logical axes `names`) moved to whole matrices, padded where a stack dimension
    was, and the steps it took (none, and `x` as it is, without an active layout or with no matrix dimension split)."""
    stored = stored_spec(names, x.shape)
    if stored is None:
        return x, ()
    entries = [entry_axes(stored, d) for d in range(x.ndim)]
    moves = whole_matrix_moves(entries, x.shape, matrix_dims, dict(active_layout().mesh.shape))
    for move in moves:
        if move.shape != x.shape:
            x = jnp.pad(x, [(0, new - old) for old, new in zip(x.shape, move.shape, strict=True)])
        x = constrain_to_spec(x, spec_of(move.after))
    return x, moves


def to_stored(x: jax.Array, names: Sequence[str | None], shape: Sequence[int], moves: Sequence[Move]) -> jax.Array:
    """`x`, at the end of `moves` (`to_whole_matrices`), back in the optimizer state's layout and `shape` the way it
    came: each step undone in turn (the layout before it is valid for the padded array too, padding going only to
    a dimension no axis split), its padding then dropped by a local slice."""
    if not moves:
        return x
    stored = stored_spec(names, shape)
    before = [(tuple(shape), tuple(entry_axes(stored, d) for d in range(len(shape)))),
              *((m.shape, m.after) for m in moves[:-1])]
    for (old_shape, entries), move in zip(reversed(before), reversed(moves), strict=True):
        x = constrain_to_spec(x, spec_of(entries))
        if old_shape != move.shape:
            x = x[tuple(slice(0, n) for n in old_shape)]
    return x

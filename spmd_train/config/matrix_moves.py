"""How a stack of matrices split over the mesh is made whole, matrix by matrix, for an optimizer that needs whole
matrices (Muon's Newton-Schulz iteration): one rule for the engine (`sharding.whole_matrices`) and the planner's
bytes (`analysis.plan.comm`). No jax.

A stored matrix is split over the ZeRO and tensor axes. Left to partition X Xᵀ itself, XLA gathers the shards again
for every product of the iteration (5.6 bytes moved per byte of matrix over fsdp 4 x tensor 2, fifteen all-gathers).
Instead each mesh axis that splits a matrix's own dimensions moves, one at a time (XLA moves one axis with one
all-to-all, several at once through a full gather), to a stack dimension (layers, experts): every device then holds
whole matrices, its share of the stack, and orthogonalises only those. A stack too short for the axis (32 layers over
fsdp 64) is padded with zero matrices to a multiple of it first, while that costs at most half a gather's bytes;
past that (a single MTP layer over fsdp 64) the axis is gathered, and the devices along it orthogonalise the same
matrices (as Liu et al. 2025, "Muon is Scalable for LLM Training", arXiv:2502.16982, §2.3, gather each matrix over the
data-parallel group). The result goes back the way it came: moved axes by all-to-all, then the padding dropped;
gathered axes by taking the local slice (no collective).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

Entries = tuple[tuple[str, ...], ...]
"""A layout: the mesh axes on each dimension of an array."""


class Move(NamedTuple):
    """One step towards whole matrices."""

    axis: str
    dim: int | None
    """The stack dimension the axis moved to (an all-to-all), or None: gathered (an all-gather)."""
    shape: tuple[int, ...]
    """The array's shape after the step: the stack dimension padded to a multiple of its new split."""
    after: Entries


def whole_matrix_moves(entries: Sequence[Sequence[str]], shape: Sequence[int], matrix_dims: Sequence[int],
                       mesh_shape: Mapping[str, int]) -> tuple[Move, ...]:
    """The steps that take an array of `shape` laid out as `entries` to one whose `matrix_dims` are whole on every
    device, one mesh axis at a time (the last step's layout is the whole-matrix one; none when none is split)."""
    now = [tuple(e) for e in (*entries, *((),) * (len(shape) - len(entries)))]
    size = list(shape)
    stack = [d for d in range(len(shape)) if d not in matrix_dims]
    moves = []
    for dim in matrix_dims:
        for axis in now[dim]:
            k = mesh_shape[axis]
            now[dim] = tuple(a for a in now[dim] if a != axis)
            ways = {d: math.prod(mesh_shape[a] for a in now[d]) * k for d in stack}
            home = next((d for d in stack if size[d] % ways[d] == 0), None)
            if home is None:  # pad a stack dimension no axis splits yet, if that moves at most half a gather's bytes
                free = [d for d in stack if not now[d]]
                padded = {d: -(-size[d] // k) * k for d in free}
                home = next((d for d in free if 2 * padded[d] / size[d] <= k), None)
                if home is not None:
                    size[home] = padded[home]
            if home is not None:
                now[home] = (*now[home], axis)
            moves.append(Move(axis, home, tuple(size), tuple(now)))
    return tuple(moves)


def whole_matrix_bytes(moves: Sequence[Move], shape: Sequence[int], local_bytes: float,
                       mesh_shape: Mapping[str, int]) -> tuple[tuple[str, str, float], ...]:
    """(op, mesh axis, bytes each device sends) of making whole and back (`whole_matrix_moves`) an array of `shape`
    of which each device holds `local_bytes` before: an all-to-all there and one back for each moved axis (each
    device keeps 1/k of its block, padding included), an all-gather for each gathered one (k - 1 blocks in; the
    slice back moves nothing)."""
    out, size = [], math.prod(shape)
    for move in moves:
        k = mesh_shape[move.axis]
        local_bytes *= math.prod(move.shape) / size  # padding
        size = math.prod(move.shape)
        if move.dim is None:
            out.append(("all-gather", move.axis, local_bytes * (k - 1)))
            local_bytes *= k
        else:
            out.append(("all-to-all", move.axis, 2 * local_bytes * (k - 1) / k))
    return tuple(out)


def local_matrices(moves: Sequence[Move], entries: Sequence[Sequence[str]], shape: Sequence[int],
                   matrix_dims: Sequence[int], mesh_shape: Mapping[str, int]) -> float:
    """Matrices each device orthogonalises once the moves are made (padding included): its block of the stack."""
    final, final_shape = (moves[-1].after, moves[-1].shape) if moves else (entries, tuple(shape))
    return math.prod(n / math.prod(mesh_shape[a] for a in final[d]) if d < len(final) else n
                     for d, n in enumerate(final_shape) if d not in matrix_dims)

"""A VJP's residuals split into the weights it re-reads and the values that must be kept for the backward pass.

`jax.vjp` returns a pytree whose leaves are the residuals. Weights that reach the backward unchanged appear as the
very input arrays: they need not be kept (a pipeline stash, a cond's outputs), only the other leaves do. The
backward rebuilds the VJP from (weights, kept leaves) with the tree structure of the trace that split it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def _weight_index(leaves: list, weights: list) -> list[int | None]:
    """For each residual leaf, the index of the weight it *is* (identity), else None."""
    ids = {id(w): i for i, w in enumerate(weights)}
    return [ids.get(id(leaf)) for leaf in leaves]


def split_residuals(vjp: Any, weights: Any) -> tuple[Any, list[int | None], list[jax.Array]]:
    """(tree structure, per leaf the index of the weight it is or None, the leaves to keep) of a VJP taken with
    respect to `weights` among other inputs."""
    leaves, treedef = jax.tree.flatten(vjp)
    index = _weight_index(leaves, jax.tree.leaves(weights))
    return treedef, index, [leaf for leaf, w in zip(leaves, index, strict=True) if w is None]


def rebuild_vjp(treedef: Any, index: list[int | None], weights: Any, kept: list[jax.Array]) -> Callable:
    """The VJP function back from its weights and the leaves `split_residuals` kept."""
    weight_leaves, rest = jax.tree.leaves(weights), iter(kept)
    return jax.tree.unflatten(treedef, [next(rest) if w is None else weight_leaves[w] for w in index])

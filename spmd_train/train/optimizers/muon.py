"""optim.name=muon: Nesterov momentum orthogonalised by Newton-Schulz iterations on each weight matrix (Jordan et
al. 2024, "Muon: An optimizer for hidden layers in neural networks"), AdamW on every other parameter.

The two parts are an `optax.partition`: AdamW here is `optim.name=adamw` exactly (b1 0.9, decaying matrices only),
so the two optimizers differ only on the matrices Muon takes (`config.optimizer_facts.muon_dimensions`: the hidden
weight matrices; not the vocabulary tables, the router, norms or biases). `optax.contrib.muon` is not used: its
AdamW part decays every parameter it holds and runs Nesterov momentum, and its iteration cannot be told where to run.

Each orthogonalised update is scaled to AdamW's typical RMS, 0.2 * sqrt(max(fan_in, fan_out)) (Liu et al. 2025, "Muon
is Scalable for LLM Training", arXiv:2502.16982), so that one `optim.lr` and `optim.weight_decay` serve both parts.

Sharded: each matrix is orthogonalised whole, on one device, the stack's matrices shared out over the devices that
held its shards (`sharding.whole_matrices`): one all-to-all there and back per stack, where leaving the products to
XLA gathered the shards again for every one of them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from spmd_train.config.optimizer_facts import NEWTON_SCHULZ, NEWTON_SCHULZ_STEPS, muon_dimensions
from spmd_train.config.train_schema import OptimConfig
from spmd_train.sharding.constrain import constrain_to_spec
from spmd_train.sharding.whole_matrices import spec_of, to_stored, to_whole_matrices
from spmd_train.train.optimizer_registry import Optimizer, register_optimizer

ADAMW_RMS = 0.2
"""The RMS an orthogonalised update is scaled to: AdamW's typical update RMS (Liu et al. 2025, §2.2)."""
ADAMW_B1 = 0.9
"""The AdamW part's first-moment decay (`optim.b1` is Muon's momentum)."""


@dataclass(frozen=True)
class Matrix:
    """How Muon sees one parameter: its logical axes and the dimensions its matrix reads along and writes to."""

    names: tuple[str | None, ...]
    reads: tuple[int, ...]
    writes: tuple[int, ...]


class MuonState(NamedTuple):
    """Muon's momentum, one per matrix, in the parameter's dtype and layout."""

    momentum: Any


def newton_schulz(x: jax.Array, keep: Callable[[jax.Array], jax.Array] = lambda x: x) -> jax.Array:
    """The orthogonalised direction of each matrix in the last two dimensions of `x` (U S' Vᵀ for x = U S Vᵀ, S'
    near 1), in float32; `keep` pins each iterate's layout (the matrices whole where they are)."""
    x = x.astype(jnp.float32)
    tall = x.shape[-2] > x.shape[-1]
    if tall:  # iterate on the smaller Gram matrix
        x = jnp.swapaxes(x, -1, -2)
    x = keep(x / (jnp.sqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True)) + 1e-7))
    a, b, c = NEWTON_SCHULZ
    for _ in range(NEWTON_SCHULZ_STEPS):
        gram = jnp.einsum("...ik,...jk->...ij", x, x)
        x = keep(a * x + jnp.einsum("...ij,...jk->...ik", b * gram + c * jnp.einsum("...ij,...jk->...ik", gram, gram),
                                    x))
    return jnp.swapaxes(x, -1, -2) if tall else x


def orthogonalise(direction: jax.Array, matrix: Matrix) -> jax.Array:
    """`direction` with each of its matrices orthogonalised whole, and scaled to AdamW's update RMS."""
    dims = matrix.reads + matrix.writes
    whole, moves = to_whole_matrices(direction, matrix.names, dims)
    shape = whole.shape  # the stack padded where the matrices were shared out over more devices than it has
    stack = [d for d in range(len(shape)) if d not in dims]
    order = [*stack, *matrix.reads, *matrix.writes]
    rows, cols = math.prod(shape[d] for d in matrix.reads), math.prod(shape[d] for d in matrix.writes)
    flat = jnp.transpose(whole, order).reshape(*(shape[d] for d in stack), rows, cols)
    keep = (lambda x: x) if not moves else functools.partial(
        constrain_to_spec, spec=spec_of([*(moves[-1].after[d] for d in stack), (), ()]))
    out = newton_schulz(flat, keep).reshape(*(shape[d] for d in order)).transpose(_inverse(order))
    out = out.astype(direction.dtype) * (ADAMW_RMS * math.sqrt(max(rows, cols)))
    return to_stored(out, matrix.names, direction.shape, moves)


def _inverse(order: list[int]) -> list[int]:
    """The permutation that undoes `order`."""
    return sorted(range(len(order)), key=order.__getitem__)


def scale_by_orthogonalised_momentum(beta: float, matrices: Any) -> optax.GradientTransformation:
    """Muon's direction for each matrix of `matrices` (a tree of `Matrix`): the Nesterov average (1 - beta) g + beta m
    of the gradient and the momentum m <- beta m + (1 - beta) g, orthogonalised (`orthogonalise`)."""

    def init_fn(params: Any) -> MuonState:
        return MuonState(jax.tree.map(jnp.zeros_like, params))

    def update_fn(updates: Any, state: MuonState, params: Any = None) -> tuple[Any, MuonState]:
        del params
        momentum = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g, state.momentum, updates)
        out = jax.tree.map(lambda g, m, matrix: orthogonalise((1 - beta) * g + beta * m, matrix), updates, momentum,
                           matrices)
        return out, MuonState(momentum)

    return optax.GradientTransformation(init_fn, update_fn)


def build_muon(cfg: OptimConfig, lr: optax.Schedule, mask: Any, moments: Mapping[str, float | None],
               logical: Any) -> optax.GradientTransformation:
    """Muon (momentum b1) on the matrices `muon_dimensions` names, AdamW (b1 0.9, b2, eps) on the rest; decoupled
    weight decay lr_t * weight_decay * p on the masked parameters of both."""
    def matrix(spec: P) -> Matrix | None:
        dims = muon_dimensions(tuple(spec))
        return None if dims is None else Matrix(tuple(spec), *dims)

    found = jax.tree.map(matrix, logical, is_leaf=lambda x: isinstance(x, P))
    is_found = lambda x: x is None or isinstance(x, Matrix)
    labels = jax.tree.map(lambda m: "adamw" if m is None else "muon", found, is_leaf=is_found)

    def only(label: str, tree: Any) -> Any:
        """`tree` as the `label` part sees it: the other part's leaves masked out (optax.partition's view)."""
        return jax.tree.map(lambda kind, x: x if kind == label else optax.MaskedNode(), labels, tree)

    matrices = only("muon", found)
    orthogonalised = optax.chain(
        scale_by_orthogonalised_momentum(moments["b1"], matrices),
        optax.add_decayed_weights(cfg.weight_decay, only("muon", mask)),
        optax.scale_by_learning_rate(lr),
    )
    adamw = optax.adamw(lr, b1=ADAMW_B1, b2=moments["b2"], eps=moments["eps"], weight_decay=cfg.weight_decay,
                        mask=only("adamw", mask))
    return optax.partition({"muon": orthogonalised, "adamw": adamw}, labels)


register_optimizer(Optimizer("muon", build_muon))

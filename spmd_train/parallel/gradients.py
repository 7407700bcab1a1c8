"""Loss and gradients of one global batch, with one gradient reduction per step per replica axis.

Forward and backward run in a `shard_map` manual over the axes the gradients are replicated on; each device
sums its own gradient over all microbatches and one explicit reduction per step sums it: a reduce-scatter into
the optimizer's shard over the ZeRO axes (ZeRO-1), a psum over the others. `tensor`, and `fsdp` from ZeRO stage 2,
stay compiler-partitioned (deliberately: see the docs).

Details: docs/architecture.md#the-gradient-region
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from spmd_train.sharding.arithmetic import entry_axes, spec_axes, spec_entry
from spmd_train.sharding.constrain import constrain
from spmd_train.sharding.layout import Layout

ValueAndGrad = Callable[[Any, Any], tuple[Any, Any]]
"""(params, batch of one microbatch) -> (values, gradient of the loss): `jax.value_and_grad` of
the model's loss, or a pipeline schedule that computes the same thing stage by stage. `values`
is the mean loss, or any pytree of per-batch means (e.g. the loss and MoE router statistics);
each is averaged over microbatches and devices like the loss."""


def loss_and_grads(
    value_and_grad: ValueAndGrad, params: Any, batch: Any, *, layout: Layout, logical: Any, grad_accum: int
) -> tuple[jax.Array, Any]:
    """(mean values, gradient of the mean loss) over the global batch: a pytree of arrays with the rows on axis 0
    (the tokens [batch, length + 1] and what goes with them).

    Gradients come back split like the optimizer state (over the ZeRO axes from stage 1): what the update reads.
    """
    mesh, stage = layout.mesh, layout.zero_stage
    grad_layout = _shardings(layout, logical, params, fsdp=stage >= 1)
    # An axis that splits some parameter besides FSDP (`expert` under MoE) stays automatic.
    splits = {a for sh in jax.tree.leaves(_shardings(layout, logical, params, fsdp=False))
              for a in spec_axes(sh.spec)}
    manual = tuple(a for a in layout.batch_axes
                   if mesh.shape[a] > 1 and (a != "fsdp" or stage <= 1) and a not in splits)
    if not manual:
        loss, grads = _accumulate(value_and_grad, params, batch, grad_accum, scatter=None)
        return loss, jax.lax.with_sharding_constraint(grads, grad_layout)

    ways = 1
    for axis in manual:
        ways *= mesh.shape[axis]
    # Parameters are replicated over every manual axis (that is what puts an axis in `manual`), so they enter
    # whole along them. Gradients leave split over the manual ZeRO axes (stage 1: `fsdp`, and `sequence` when the
    # rules shard over it), whole along the rest.
    out_grads = _specs(grad_layout, keep=lambda a: a in manual)

    def local(params, batch):
        # Without varying-axis checks (check_vma=False below) autodiff returns this device's own
        # gradient contribution, with no implicit psum in every microbatch's backward pass; the
        # one reduction is the explicit psum below. Checks are off because Pallas kernels (in
        # their own nested shard_map) cannot carry varying-axis types.
        scatter = None
        if stage == 2 and mesh.shape["fsdp"] > 1:
            # ZeRO-2: each microbatch's gradient is reduce-scattered into its shard as it is made.
            auto_specs = _specs(grad_layout, keep=lambda a: a not in manual)
            scatter = lambda g: jax.lax.with_sharding_constraint(g, auto_specs)
        loss, grads = _accumulate(value_and_grad, params, batch, grad_accum, scatter=scatter)
        # The step's single reduction over these axes: ZeRO-1 reduce-scatters into the optimizer's shard (the
        # update reads only its shard; the updated parameters are gathered once), so a step moves 2Ψ over `fsdp`
        # where an all-reduce and that gather moved 3Ψ.
        grads = jax.tree.map(lambda g, spec: _reduce(g, spec, manual) / ways, grads, out_grads)
        return jax.tree.map(lambda v: jax.lax.psum(v, manual) / ways, loss), grads

    loss, grads = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P(manual)),
        out_specs=(P(), out_grads),
        axis_names=set(manual),
        check_vma=False,
    )(params, batch)
    return loss, jax.lax.with_sharding_constraint(grads, grad_layout)


def _reduce(g: jax.Array, spec: P, manual: tuple[str, ...]) -> jax.Array:
    """The sum of `g` over the manual axes, left split over those `spec` places on its dimensions."""
    done: list[str] = []
    for dim in range(len(spec)):
        axes = entry_axes(spec, dim)
        if axes:
            g = jax.lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True)
            done.extend(axes)
    rest = tuple(a for a in manual if a not in done)
    return jax.lax.psum(g, rest) if rest else g


def _accumulate(value_and_grad: ValueAndGrad, params: Any, batch: Any, grad_accum: int, scatter):
    """Mean loss and summed-then-averaged gradients over `grad_accum` microbatches."""
    if grad_accum == 1:
        loss, grads = value_and_grad(params, batch)
        return loss, scatter(grads) if scatter else grads
    rows = jax.tree.leaves(batch)[0].shape[0]
    # Row r of microbatch i is row r * grad_accum + i: every device's rows split evenly among
    # microbatches, so building them moves no data between devices.
    split = lambda a: constrain(a.reshape(rows // grad_accum, grad_accum, *a.shape[1:]).swapaxes(0, 1),
                                (None, "batch", *(None,) * (a.ndim - 1)))
    micro = jax.tree.map(split, batch)

    def add(carry, mb):
        loss_sum, grad_sum = carry
        loss, grads = value_and_grad(params, mb)
        if scatter:
            grads = scatter(grads)
        return (jax.tree.map(jnp.add, loss_sum, loss), jax.tree.map(jnp.add, grad_sum, grads)), None

    first_loss, first = value_and_grad(params, jax.tree.map(lambda a: a[0], micro))
    if scatter:
        first = scatter(first)
    # Peeling the first microbatch gives the accumulator the exact type (shape, varying axes) of a gradient.
    (loss_sum, grad_sum), _ = jax.lax.scan(add, (first_loss, first), jax.tree.map(lambda a: a[1:], micro))
    return jax.tree.map(lambda v: v / grad_accum, loss_sum), jax.tree.map(lambda g: g / grad_accum, grad_sum)


def _shardings(layout: Layout, logical: Any, params: Any, *, fsdp: bool) -> Any:
    return layout.tree_shardings(logical, params, fsdp=fsdp)


def _specs(shardings: Any, keep: Callable[[str], bool]) -> Any:
    """Each sharding's PartitionSpec with only the mesh axes `keep` accepts."""

    def entry(spec, dim):
        return spec_entry(tuple(a for a in entry_axes(spec, dim) if keep(a)))

    return jax.tree.map(lambda s: P(*(entry(s.spec, d) for d in range(len(s.spec)))), shardings)

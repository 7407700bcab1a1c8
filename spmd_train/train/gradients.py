"""Loss and gradients of one global batch: data parallelism and ZeRO written out by hand.

The forward and backward passes run inside one `shard_map` that is manual over the batch
axes (`data`, `fsdp`, `expert`, those of size > 1); `tensor` stays compiler-partitioned
inside. That makes every gradient reduction an explicit, countable collective:

- ZeRO-3: each weight is all-gathered over `fsdp` where it is used (`stored_param`); the
  transpose of that gather is a reduce-scatter, so each layer's gradient leaves the
  backward pass already summed into its shard. Weights are gathered again in the backward
  pass rather than kept (see `models.layers.dense`).
- ZeRO-2: each microbatch's gradient is reduce-scattered over `fsdp` as it is produced.
- Gradients replicated over an axis (`data` and `expert` always, `fsdp` below stage 2) are
  summed locally over all microbatches and reduced once per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from spmd_train.config.checks import BATCH_AXES
from spmd_train.sharding.constrain import constrain
from spmd_train.sharding.rules import Layout

LossFn = Callable[[Any, jax.Array], jax.Array]


def loss_and_grads(
    loss_fn: LossFn, params: Any, tokens: jax.Array, *, layout: Layout, logical: Any, grad_accum: int
) -> tuple[jax.Array, Any]:
    """(mean loss, gradient of the mean loss) over the global batch `tokens` [batch, length + 1].

    Gradients come back in the ZeRO stage's gradient layout.
    """
    mesh, stage = layout.mesh, layout.zero_stage
    manual = tuple(a for a in BATCH_AXES if mesh.shape[a] > 1)
    grad_layout = _shardings(layout, logical, params, fsdp=stage >= 2)
    if not manual:
        loss, grads = _accumulate(loss_fn, params, tokens, grad_accum, scatter=None)
        return loss, jax.lax.with_sharding_constraint(grads, grad_layout)

    ways = 1
    for axis in manual:
        ways *= mesh.shape[axis]
    fsdp_manual = "fsdp" in manual
    param_specs = _manual_specs(_shardings(layout, logical, params, fsdp=stage >= 3), manual)
    grad_specs = _manual_specs(grad_layout, manual)
    # Axes whose reduction waits for the end of the step: everything the gradients are
    # replicated over. At stage >= 2 `fsdp` is reduced as it goes (reduce-scatter).
    deferred = tuple(a for a in manual if a != "fsdp" or stage <= 1)

    def local(params, tokens):
        # The stored (possibly fsdp-sharded) weights become "varying" over every manual axis,
        # so autodiff returns this device's own gradient contribution with no implicit psum.
        params = jax.tree.map(lambda p, s: _vary(p, manual, s), params, param_specs, is_leaf=_is_leaf)
        scatter = None
        if stage == 2 and fsdp_manual:
            scatter = lambda g: jax.tree.map(_scatter_fsdp, g, grad_specs, is_leaf=_is_leaf)  # noqa: E731
        loss, grads = _accumulate(loss_fn, params, tokens, grad_accum, scatter=scatter)
        if deferred:
            grads = jax.lax.psum(grads, deferred)  # the step's single reduction over these axes
        grads = jax.tree.map(lambda g: g / ways, grads)
        return jax.lax.psum(loss, manual) / ways, grads

    loss, grads = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(param_specs, P(manual)),
        out_specs=(P(), grad_specs),
        axis_names=set(manual),
    )(params, tokens)
    return loss, jax.lax.with_sharding_constraint(grads, grad_layout)


def _accumulate(loss_fn: LossFn, params: Any, tokens: jax.Array, grad_accum: int, scatter):
    """Mean loss and summed-then-averaged gradients over `grad_accum` microbatches."""
    if grad_accum == 1:
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        return loss, scatter(grads) if scatter else grads
    batch = tokens.shape[0]
    # Row r of microbatch i is row r * grad_accum + i: every device's rows split evenly among
    # microbatches, so building them moves no data between devices.
    micro = constrain(tokens.reshape(batch // grad_accum, grad_accum, -1).swapaxes(0, 1), (None, "batch", None))

    def add(carry, mb):
        loss_sum, grad_sum = carry
        loss, grads = jax.value_and_grad(loss_fn)(params, mb)
        if scatter:
            grads = scatter(grads)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

    first_loss, first = jax.value_and_grad(loss_fn)(params, micro[0])
    if scatter:
        first = scatter(first)
    # Peeling the first microbatch gives the accumulator the exact type (shape, varying axes) of a gradient.
    (loss_sum, grad_sum), _ = jax.lax.scan(add, (first_loss, first), micro[1:])
    return loss_sum / grad_accum, jax.tree.map(lambda g: g / grad_accum, grad_sum)


def _shardings(layout: Layout, logical: Any, params: Any, *, fsdp: bool) -> Any:
    return layout.tree_shardings(logical, params, fsdp=fsdp)


def _manual_specs(shardings: Any, manual: tuple[str, ...]) -> Any:
    """Each sharding's PartitionSpec restricted to the manual axes (what shard_map sees)."""

    def keep(entry):
        axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a in manual)
        return None if not axes else axes[0] if len(axes) == 1 else axes

    return jax.tree.map(lambda s: P(*(keep(e) for e in s.spec)), shardings)


def _vary(x: jax.Array, manual: tuple[str, ...], spec: P) -> jax.Array:
    sharded = {a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)}
    invariant = tuple(a for a in manual if a not in sharded)
    return jax.lax.pcast(x, invariant, to="varying") if invariant else x


def _scatter_fsdp(g: jax.Array, spec: P) -> jax.Array:
    for dim, entry in enumerate(spec):
        if entry == "fsdp" or (isinstance(entry, tuple) and "fsdp" in entry):
            return jax.lax.psum_scatter(g, "fsdp", scatter_dimension=dim, tiled=True)
    return jax.lax.psum(g, "fsdp")  # a gradient with no fsdp-split dimension stays whole


def _is_leaf(x: Any) -> bool:
    return isinstance(x, P)

"""Loss and gradients of one global batch, with gradient accumulation over microbatches.

With `grad_accum` > 1 the microbatch loop runs inside a `shard_map` that is manual over the
deferred batch axes (those gradients are replicated over): each device sums its own
microbatch gradients locally and the cross-device reduction happens once per step, not
once per microbatch. All other axes (fsdp at ZeRO >= 2, tensor) stay compiler-partitioned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from spmd_train.sharding.constrain import constrain

LossFn = Callable[[Any, jax.Array], jax.Array]


def accumulated_grads(
    loss_fn: LossFn,
    params: Any,
    tokens: jax.Array,
    *,
    grad_accum: int,
    mesh: Mesh,
    deferred_axes: tuple[str, ...],
    grad_shardings: Any,
) -> tuple[jax.Array, Any]:
    """(mean loss, gradient of the mean loss) over the global batch `tokens` [batch, length + 1]."""
    if grad_accum == 1:
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        return loss, jax.lax.with_sharding_constraint(grads, grad_shardings)
    if not deferred_axes:
        return _microbatch_loop(loss_fn, params, tokens, grad_accum, grad_shardings)

    def local(params, tokens):
        # Marking the replicated parameters as varying keeps autodiff from inserting a psum
        # into every microbatch's backward pass (the transpose of an implicit broadcast).
        params = jax.tree.map(lambda p: jax.lax.pcast(p, deferred_axes, to="varying"), params)
        loss, grads = _microbatch_loop(loss_fn, params, tokens, grad_accum, None)
        return jax.tree.map(lambda x: x[None], (loss, grads))

    # Each device returns its own partial sums, stacked on a new leading axis; summing that
    # axis outside is the single cross-device gradient reduction of the step.
    losses, stacked = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P(deferred_axes)),
        out_specs=(P(deferred_axes), P(deferred_axes)),
        axis_names=set(deferred_axes),
    )(params, tokens)
    grads = jax.tree.map(lambda g: jnp.mean(g, axis=0), stacked)
    return jnp.mean(losses), jax.lax.with_sharding_constraint(grads, grad_shardings)


def _microbatch_loop(loss_fn: LossFn, params: Any, tokens: jax.Array, grad_accum: int, grad_shardings: Any):
    batch = tokens.shape[0]
    # Row r of microbatch i is row r * grad_accum + i: every device's rows split evenly among
    # microbatches, so building them moves no data between devices.
    micro = tokens.reshape(batch // grad_accum, grad_accum, -1).swapaxes(0, 1)
    micro = constrain(micro, (None, "batch", None))

    def add(carry, mb):
        loss_sum, grad_sum = carry
        loss, grads = jax.value_and_grad(loss_fn)(params, mb)
        grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
        if grad_shardings is not None:
            grad_sum = jax.lax.with_sharding_constraint(grad_sum, grad_shardings)
        return (loss_sum + loss, grad_sum), None

    zeros = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)
    if grad_shardings is not None:
        zeros = jax.lax.with_sharding_constraint(zeros, grad_shardings)
    loss_zero = jnp.zeros_like(jax.tree.leaves(params)[0], jnp.float32, shape=())
    (loss_sum, grad_sum), _ = jax.lax.scan(add, (loss_zero, zeros), micro)
    return loss_sum / grad_accum, jax.tree.map(lambda g: g / grad_accum, grad_sum)

"""precision.loss_scale=dynamic: float16's gradients scaled into its range, the scale found by overflowing.

float16 keeps 5 exponent bits: gradients below 2^-24 flush to zero. The step's objective is multiplied by the scale
before the backward pass (every cotangent with it), and the gradients divided by it in float32 before the optimizer
sees them (Micikevicius et al. 2018, "Mixed Precision Training"). A step whose gradients overflow is skipped by the
step guards (`guards.judge`, reason "overflow") and halves the scale; `growth_interval` applied steps in a row double
it (PyTorch's `GradScaler` rule, its defaults: 2^16, x0.5, x2 after 2000). The scale is optimizer state: in metrics as
`loss_scale`, in every checkpoint, and a resume goes on with it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

BACKOFF = 0.5
"""What an overflowing step multiplies the scale by."""
GROWTH = 2.0
"""What `growth_interval` applied steps in a row multiply the scale by."""
MIN_SCALE = 1.0
"""The scale never falls below 1: an overflow at scale 1 is the model's own, which the guards count toward halting."""


class LossScaleState(NamedTuple):
    """The loss scale, the applied steps since it last changed, and the inner optimizer's state."""

    scale: jax.Array
    """float32 scalar."""
    good_steps: jax.Array
    """int32 scalar: applied steps since the last overflow or growth."""
    inner: Any


def with_loss_scale(inner: optax.GradientTransformation, init_scale: float) -> optax.GradientTransformation:
    """`inner` with a dynamic loss scale in its state; its update takes gradients already divided by the scale
    (`unscale`) and leaves the scale to `adjust`, which the step calls once it has judged the step."""

    def init_fn(params: Any) -> LossScaleState:
        return LossScaleState(jnp.asarray(init_scale, jnp.float32), jnp.zeros((), jnp.int32), inner.init(params))

    def update_fn(grads: Any, state: LossScaleState, params: Any = None) -> tuple[Any, LossScaleState]:
        updates, inner_state = inner.update(grads, state.inner, params)
        return updates, state._replace(inner=inner_state)

    return optax.GradientTransformation(init_fn, update_fn)


def unscale(grads: Any, scale: jax.Array) -> Any:
    """Gradients of the scaled objective, divided by the scale in float32 (float16's small gradients would
    underflow if divided in float16); float32 and bfloat16 gradients keep their dtype."""

    def one(g: jax.Array) -> jax.Array:
        out = g.astype(jnp.float32) / scale
        return out if g.dtype == jnp.float16 else out.astype(g.dtype)

    return jax.tree.map(one, grads)


def adjust(state: LossScaleState, overflow: jax.Array, applied: jax.Array, growth_interval: int) -> LossScaleState:
    """The scale after a step: halved (not below MIN_SCALE) when its gradients overflowed, doubled after
    `growth_interval` applied steps in a row; a step skipped for another reason (a spike) leaves it and its count."""
    good = state.good_steps + applied.astype(jnp.int32)
    grow = good >= growth_interval
    scale = jnp.where(overflow, jnp.maximum(state.scale * BACKOFF, MIN_SCALE),
                      jnp.where(grow, state.scale * GROWTH, state.scale))
    good = jnp.where(overflow | grow, 0, good)
    return state._replace(scale=scale.astype(jnp.float32), good_steps=good.astype(jnp.int32))

"""precision.master=float32: the optimizer works on a float32 master copy of bfloat16 parameters.

The master copy is optimizer state (sharded like it, from ZeRO stage 1), so the inner optimizer's moments are float32
too: 2 bytes of parameter, 2 of gradient and 4 + 8 of optimizer state per parameter, the ZeRO paper's mixed-precision
Adam (Rajbhandari et al. 2020, §3.1). Each step the gradient is cast to float32, the inner optimizer updates the
master copy, and the update handed back is the difference between the master's bfloat16 rounding and the stored
parameter, in float32: `optax.apply_updates` adds it in float32, so the stored parameter becomes exactly that rounding.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class MasterState(NamedTuple):
    """The float32 master copy of the parameters and the inner optimizer's state over it."""

    master: Any
    inner: Any


def to_f32(tree: Any) -> Any:
    """Every array of `tree` in float32: the master copy of parameters, and gradients as the master copy takes them."""
    return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


def with_master_copy(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` run on a float32 master copy of the parameters (see the module's docstring)."""

    def init_fn(params: Any) -> MasterState:
        master = to_f32(params)
        return MasterState(master, inner.init(master))

    def update_fn(grads: Any, state: MasterState, params: Any = None) -> tuple[Any, MasterState]:
        if params is None:
            raise ValueError("the master copy needs the stored parameters to hand back their update")
        updates, inner_state = inner.update(to_f32(grads), state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        rounded = jax.tree.map(lambda m, p: m.astype(p.dtype).astype(jnp.float32) - p.astype(jnp.float32), master,
                               params)
        return rounded, MasterState(master, inner_state)

    return optax.GradientTransformation(init_fn, update_fn)

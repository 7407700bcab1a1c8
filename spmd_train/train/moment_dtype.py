"""precision.moments: the optimizer's moments stored in another dtype than the parameters'.

Each step the optimizer computes its new moments from the stored ones and the gradients (jax promotes a bfloat16
moment and a float32 gradient to float32), and they are stored back rounded to the chosen dtype: bfloat16 moments
halve AdamW's 8 bytes per float32 parameter, float32 moments keep bfloat16 parameters' moments exact. Every
floating-point array of the state is the moments' (AdamW's mu and nu, Lion's and Muon's momentum, Adafactor's factored
second moments and its momentum); step counts stay integers.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax


def with_moment_dtype(inner: optax.GradientTransformation, dtype: str) -> optax.GradientTransformation:
    """`inner` with every floating-point array of its state stored in `dtype`."""
    target = jnp.dtype(dtype)

    def cast(state: Any) -> Any:
        return jax.tree.map(lambda x: x.astype(target) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)

    def init_fn(params: Any) -> Any:
        return cast(inner.init(params))

    def update_fn(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        updates, new_state = inner.update(grads, state, params)
        return updates, cast(new_state)

    return optax.GradientTransformation(init_fn, update_fn)

"""A stacked layer row that may be padding: runs the layer when live, passes its input through when not.

Uneven pipeline stages store every chunk at the deepest chunk's row count; a shorter chunk's extra rows are
padding that must cost nothing. `lax.cond` skips them, but differentiating a cond directly makes the layer's
weights residual *outputs* of the cond (the skipping branch fills them with zeros, so JAX cannot forward
them), and a pipeline's stash would keep a copy of every row's weights per microbatch in flight. The custom
VJP below saves what an unpadded layer's VJP saves: its activations through the cond, its weights as
the row's own inputs, which the scan and the stash do not copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from spmd_train.ops.vjp_residuals import rebuild_vjp, split_residuals

Layer = Callable[[jax.Array, Any, Any], tuple[jax.Array, Any]]


def _zeros(tree: Any) -> Any:
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


def padded_row(layer: Layer) -> Callable[..., tuple[jax.Array, Any]]:
    """row(x, params, live, kind) = layer(x, params, kind) when `live` (a traced bool), else (x, zero statistics).

    A padding row has no compute forward or backward, zero parameter gradients and passes the cotangent of its
    output to its input. `layer` returns (output, statistics) and may be rematerialised itself; `kind` (the
    layer's attention kind, an int or None) is not differentiated.
    """
    # The residual layout of the last trace (`ops.vjp_residuals.split_residuals`): tree structure, weight index.
    layout: dict[str, Any] = {}

    def run(x, params, kind):
        out, pullback = jax.vjp(lambda x, params: layer(x, params, kind), x, params)
        layout["tree"], layout["index"], kept = split_residuals(pullback, params)
        return out, kept

    def skip(x, params, kind):
        out, saved = jax.eval_shape(run, x, params, kind)
        return (x, _zeros(out[1])), _zeros(saved)

    @jax.custom_vjp
    def row(x, params, live, kind):
        stats = jax.eval_shape(layer, x, params, kind)[1]
        return jax.lax.cond(live, layer, lambda x, _, __: (x, _zeros(stats)), x, params, kind)

    def forward(x, params, live, kind):
        out, saved = jax.lax.cond(live, run, skip, x, params, kind)
        return out, (params, saved, live)

    def backward(residuals, cotangent):
        params, saved, live = residuals

        def pull(saved, cotangent):
            return rebuild_vjp(layout["tree"], layout["index"], params, saved)(cotangent)

        d_x, d_params = jax.lax.cond(live, pull, lambda _, ct: (ct[0], _zeros(params)), saved, cotangent)
        return d_x, d_params, None, None

    row.defvjp(forward, backward)
    return row

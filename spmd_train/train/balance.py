"""Auxiliary-loss-free balancing (DeepSeek-V3): moving each MoE layer's router bias after a step.

The bias (`models.moe.RouterBias`, one [E] row per MoE layer, stacked with its layer) is added to
the router scores for selection only. It is train state outside the optimizer: the routing stops
its gradient, the optimizer's update for it is discarded here, and after each applied step every
expert's bias moves by `rate` towards balance: up when the expert took fewer than the mean
assignments, down when more, by the sign alone (so the rate is the step size whatever the batch).

Details: docs/moe.md#auxiliary-loss-free-balancing
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spmd_train.models.layers import in_host_memory
from spmd_train.models.param_specs import in_layer_stack

BIAS = "router_bias"


def is_router_bias(path) -> bool:
    """Whether a params-tree path (`tree_map_with_path`'s) names a router bias."""
    return bool(path) and getattr(path[-1], "key", None) == BIAS


def without_bias_updates(updates: Any) -> Any:
    """The optimizer's updates with the router biases' set to zero: their value is this module's business."""
    return jax.tree_util.tree_map_with_path(lambda p, u: jnp.zeros_like(u) if is_router_bias(p) else u, updates)


def router_biases_on_device(params: Any) -> Any:
    """`params` with the router biases in device memory (offload.params keeps the layer stack's, theirs among them,
    on the host; the step computes with them). The rest is left where it is."""
    def move(path, leaf):
        return jax.device_put(leaf, jax.memory.Space.Device) if in_host_memory(leaf) and is_router_bias(path) else leaf

    return jax.tree_util.tree_map_with_path(move, params)


def update_router_bias(params: Any, load: jax.Array, rate: float) -> Any:
    """`params` with every router bias moved by rate * sign(mean load - load).

    `load` [rows, E]: the step's assignments per expert of each MoE layer (any positive scale:
    only the sign of its difference from the layer's mean counts), in the stored order of the
    layer stack's rows, as the bias rows are, then the multi-token prediction layers' (the order in
    which the parameter tree flattens their biases).
    """
    error = jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    out, used = [], 0
    for path, leaf in leaves:
        if is_router_bias(path):
            rows = leaf.size // leaf.shape[-1]
            leaf = leaf + (rate * error[used:used + rows]).reshape(leaf.shape).astype(leaf.dtype)
            used += rows
        out.append(leaf)
    if used != load.shape[0]:
        raise ValueError(f"{load.shape[0]} rows of expert load for {used} router-bias rows")
    return jax.tree_util.tree_unflatten(tree, out)


def bias_metrics(params: Any, model_rows: np.ndarray | None = None) -> dict[str, jax.Array]:
    """`router_bias.<i>`: the spread (max - min) of MoE layer i's bias, i.e. how hard balancing steers it (the layer
    stack's MoE layers in model order, then the multi-token prediction layers').

    `model_rows`: the stored row of each model row of the layer stack, when they differ (pipeline layer orders).
    """
    rows = bias_rows(params, model_rows)
    if rows is None:
        return {}
    return {f"router_bias.{i}": r for i, r in enumerate(jnp.max(rows, -1) - jnp.min(rows, -1))}


def bias_rows(params: Any, model_rows: np.ndarray | None = None) -> jax.Array | None:
    """Every MoE layer's router bias [MoE layers, E], in `bias_metrics`' order (None: the model has none)."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if is_router_bias(path):
            rows = leaf if model_rows is None or not in_layer_stack(path) else leaf[np.asarray(model_rows)]
            out.append(rows.reshape(-1, leaf.shape[-1]))
    return jnp.concatenate(out) if out else None


def balance_vectors(params: Any, counts: jax.Array, model_rows: np.ndarray | None = None) -> dict[str, jax.Array]:
    """Per expert, for histograms and the notebook API: `expert_load` [MoE layers, E], each expert's share of its
    layer's assignments in the step (rows sum to 1), and with router biases `router_bias` [MoE layers, E] after the
    step; both in model order, multi-token prediction layers last.

    `counts`: the step's assignments per expert, in the stored order of the layer stack's rows (`update_router_bias`);
    `model_rows` as in `bias_metrics`.
    """
    rows = counts if model_rows is None else counts[np.asarray(model_rows)]
    out = {"expert_load": rows / jnp.maximum(jnp.sum(rows, -1, keepdims=True), 1e-30)}
    bias = bias_rows(params, model_rows)
    if bias is not None:
        out["router_bias"] = bias
    return out

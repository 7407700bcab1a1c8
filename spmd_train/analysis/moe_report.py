"""The mixture-of-experts section of `spmd-train describe`: how the experts are laid out, by formula.

Everything here is computed from the config, the mesh and the parameter shardings; nothing
is compiled. The figures are the ones the compiled program is tested against
(tests/test_moe_model.py): a group (the unit capacity is counted over) is the tokens one
device holds of one microbatch, and each MoE layer exchanges its [E, C, d_model] slot
buffer over `expert` four times per microbatch with backends.moe=capacity (there and back in
the forward pass, and the transposes in the backward pass), six under any remat policy
(the forward pass is rerun inside the backward pass, and no policy saves an all-to-all).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from spmd_train.models.flops import active_moe_mlp_params, matmul_params, moe_layer_count
from spmd_train.ops.routing import capacity
from spmd_train.sharding.arithmetic import entry_axes, spec_axes

AXIS = "expert"


def moe_section(engine) -> dict[str, Any] | None:
    """MoE layout and expected expert-axis traffic of an `Engine`'s train step; None without MoE layers.

    Keys: moe_layers, layers (model layer index of each MoE layer, in `expert_load.<i>`
    order), num_experts, experts_per_token, num_shared_experts, moe_d_ff, impl,
    capacity_factor, expert_axis (mesh.expert), experts_per_device, batch_axes and length_axes
    (the mesh axes a group is split by), group_rows, group_tokens (tokens per group: the rows'
    share of the length under context parallelism), groups (per microbatch), capacity_slots (per expert per group; None
    when dropless), slot_buffer_bytes (E x C x d_model x compute-dtype bytes, per device and
    exchange), expert_params (path and PartitionSpec of every parameter split over `expert`),
    active_params (per token, the MFU convention) and all_to_all (count and bytes per device
    per step, with the formula).
    """
    cfg = engine.cfg
    m, t = cfg.model, cfg.train
    layers = moe_layer_count(m)
    if layers == 0:
        return None
    mesh, layout = engine.mesh, engine.layout
    ways = mesh.shape[AXIS]
    batch_axes = [a for a in entry_axes(layout.activation_spec(P("batch")), 0) if mesh.shape[a] > 1]
    # Under context parallelism a device holds 1/sequence of each row: its group is that part.
    length_axes = [a for a in entry_axes(layout.activation_spec(P(None, "length")), 1) if mesh.shape[a] > 1]
    length_ways = math.prod(mesh.shape[a] for a in length_axes)
    groups = math.prod(mesh.shape[a] for a in batch_axes) * length_ways
    # A group is one microbatch's share: of gradient accumulation and, pipelined, of the pipeline's microbatches.
    microbatches = t.grad_accum * (engine.plan.schedule.microbatches if engine.plan is not None else 1)
    rows = t.global_batch_size // (microbatches * math.prod(mesh.shape[a] for a in batch_axes))
    tokens = rows * t.seq_len // length_ways
    moe, choice = m.moe, cfg.backends
    dropless = choice.moe == "dropless"
    slots = None if dropless else capacity(moe.experts_per_token, tokens, choice.capacity_factor, moe.num_experts)
    dtype_bytes = jnp.dtype(m.compute_dtype).itemsize
    return {
        "moe_layers": layers,
        "layers": [(i + 1) * moe.every - 1 for i in range(layers)],
        "num_experts": moe.num_experts,
        "experts_per_token": moe.experts_per_token,
        "num_shared_experts": moe.num_shared_experts,
        "moe_d_ff": m.resolved_moe_d_ff,
        "impl": choice.moe,
        "capacity_factor": None if dropless else choice.capacity_factor,
        "expert_axis": ways,
        "experts_per_device": moe.num_experts // ways,
        "batch_axes": batch_axes,
        "length_axes": length_axes,
        "groups": groups,
        "group_rows": rows,
        "group_tokens": tokens,
        "capacity_slots": slots,
        "slot_buffer_bytes": None if dropless else moe.num_experts * slots * m.d_model * dtype_bytes,
        "expert_params": _expert_params(engine),
        "active_params": {"matmul": matmul_params(m), "per_moe_layer_mlp": active_moe_mlp_params(m),
                          "total": engine.num_params},
        "all_to_all": _all_to_all(cfg, layers // mesh.shape["pipeline"], microbatches, ways, slots, tokens,
                                  dtype_bytes),
    }


def _all_to_all(cfg, layers: int, microbatches: int, ways: int, slots: int | None, tokens: int,
                dtype_bytes: int) -> dict[str, Any]:
    """Expected all-to-alls over `expert` per step: count and bytes each device sends (`layers`: the MoE layers one
    device runs, all of them unless pipelined)."""
    m, moe = cfg.model, cfg.model.moe
    if ways == 1:
        return {"count": 0, "bytes_per_device": 0.0, "exact": True,
                "formula": "mesh.expert=1: every device holds every expert, no exchange"}
    per_layer = 4 if cfg.parallel.remat == "none" else 6
    count = layers * microbatches * per_layer
    share = (ways - 1) / ways  # the part of each buffer that leaves the device
    if cfg.backends.moe == "dropless":
        # ragged_all_to_all moves what the routing decides; under balanced routing a share
        # (N-1)/N of the k x tokens assignments leaves the device each way.
        exchange = moe.experts_per_token * tokens * m.d_model * dtype_bytes * share
        formula = (f"{layers} layers x {microbatches} microbatches x {per_layer} ragged exchanges "
                   f"x k={moe.experts_per_token} x {tokens} tokens x d_model={m.d_model} x {dtype_bytes} B "
                   f"x ({ways}-1)/{ways} "
                   "(balanced routing; the real figure depends on the routing)")
        return {"count": count, "per_layer_per_microbatch": per_layer, "bytes_per_exchange": exchange,
                "bytes_per_device": count * exchange, "exact": False, "formula": formula}
    exchange = moe.num_experts * slots * m.d_model * dtype_bytes * share
    formula = (f"{layers} layers x {microbatches} microbatches x {per_layer} all-to-alls x E={moe.num_experts} "
               f"x C={slots} x d_model={m.d_model} x {dtype_bytes} B x ({ways}-1)/{ways}")
    return {"count": count, "per_layer_per_microbatch": per_layer, "bytes_per_exchange": exchange,
            "bytes_per_device": count * exchange, "exact": True, "formula": formula}


def _expert_params(engine) -> list[dict[str, Any]]:
    """Parameters whose stored sharding splits a dimension over `expert`: path and PartitionSpec."""
    out = []
    for path, sharding in jax.tree_util.tree_flatten_with_path(engine.state_shardings.params)[0]:
        spec = tuple(sharding.spec)
        if AXIS in spec_axes(sharding.spec):
            out.append({"path": ".".join(str(getattr(k, "key", k)) for k in path),
                        "spec": [list(e) if isinstance(e, tuple) else e for e in spec]})
    return out


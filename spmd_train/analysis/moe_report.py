"""The mixture-of-experts section of `spmd-train describe`: how the experts are laid out, by formula.

Everything here is computed from the config, the mesh and the parameter shardings; nothing
is compiled. The exchange is the analytic model's (`analysis.plan.comm.expert_exchange`, what
`plan` counts), and the compiled program is tested against it (tests/test_moe_model.py).
"""

from __future__ import annotations

from typing import Any

import jax

from spmd_train.analysis.analytic import AnalyticLayout, analytic_layout
from spmd_train.analysis.plan.candidate import microbatches, rows_per_device
from spmd_train.analysis.plan.comm import ExpertExchange, expert_exchange
from spmd_train.models.flops import active_moe_mlp_params, matmul_params, moe_layer_count
from spmd_train.ops.capacity import devices_reached
from spmd_train.sharding.arithmetic import spec_axes

AXIS = "expert"


def moe_section(engine, layout: AnalyticLayout | None = None) -> dict[str, Any] | None:
    """MoE layout and expected expert-axis traffic of an `Engine`'s train step; None without MoE layers.

    Keys: moe_layers, layers (model layer index of each MoE layer, in `expert_load.<i>`
    order), mtp_moe_layers (the multi-token prediction modules' MoE layers, whose `expert_load.<i>` follow),
    num_experts, experts_per_token, num_shared_experts, moe_d_ff, impl,
    capacity_factor, expert_axis (mesh.expert), experts_per_device, batch_axes and length_axes
    (the mesh axes a group is split by), group_rows, group_tokens (tokens per group: the rows'
    share of the length under context parallelism), groups (per microbatch), capacity_slots (per expert per group; None
    when dropless), slot_buffer_bytes (E x C x d_model x compute-dtype bytes, per device and
    exchange), expert_params (path and PartitionSpec of every parameter split over `expert`),
    active_params (per token, the MFU convention) and all_to_all (count and bytes per device
    per step, with the formula). `layout`: the engine's `analytic_layout`, when the caller has it.
    """
    cfg = engine.cfg
    m = cfg.model
    layers = moe_layer_count(m)
    if layers == 0:
        return None
    a = layout or analytic_layout(engine)
    c, x = a.candidate, expert_exchange(a.shape, a.candidate, a.workload)
    moe, choice = m.moe, cfg.backends
    dropless = choice.moe == "dropless"
    slots = None if dropless else int(x.slots)
    rows = rows_per_device(c, a.workload)
    rows //= microbatches(c, rows)  # a group's rows: one microbatch's
    return {
        "moe_layers": layers,
        "layers": [i for i in range(m.num_layers) if m.is_moe_layer(i)],
        "mtp_moe_layers": a.shape.mtp_moe_layers,
        "num_experts": moe.num_experts,
        "experts_per_token": moe.experts_per_token,
        "num_shared_experts": moe.num_shared_experts,
        "moe_d_ff": m.resolved_moe_d_ff,
        "impl": choice.moe,
        "capacity_factor": None if dropless else choice.capacity_factor,
        "expert_axis": c.expert,
        "experts_per_device": moe.num_experts // c.expert,
        "batch_axes": list(c.split_by("batch")),
        "length_axes": list(c.split_by("length")),
        "groups": c.batch_ways * c.length_ways,
        "group_rows": rows,
        "group_tokens": _whole(x.group_tokens),
        "capacity_slots": slots,
        "slot_buffer_bytes": None if dropless else moe.num_experts * slots * m.d_model * a.shape.compute_bytes,
        "expert_params": _expert_params(engine),
        "active_params": {"matmul": matmul_params(m), "per_moe_layer_mlp": active_moe_mlp_params(m),
                          "total": engine.num_params},
        "all_to_all": _all_to_all(cfg, x, c.expert, a.shape.compute_bytes),
    }


def _whole(n: float) -> float | int:
    return int(n) if float(n).is_integer() else n


def _all_to_all(cfg, x: ExpertExchange, ways: int, dtype_bytes: int) -> dict[str, Any]:
    """Expected all-to-alls over `expert` per step: count and bytes each device sends, with the formula."""
    m, moe = cfg.model, cfg.model.moe
    if ways == 1:
        return {"count": 0, "bytes_per_device": 0.0, "exact": True,
                "formula": "mesh.expert=1: every device holds every expert, no exchange"}
    count, layers, tokens = _whole(x.count), _whole(x.layers), _whole(x.group_tokens)
    head = f"{layers} layers x {x.microbatches} microbatches x {x.per_layer}"
    common = {"count": count, "per_layer_per_microbatch": x.per_layer, "bytes_per_exchange": x.bytes_per_exchange,
              "bytes_per_device": x.total_bytes}
    if cfg.backends.moe == "dropless":
        # ragged_all_to_all moves what the routing decides; under balanced routing a share
        # (N-1)/N of the k x tokens assignments leaves the device each way.
        formula = (f"{head} ragged exchanges x k={moe.experts_per_token} x {tokens} tokens x d_model={m.d_model} "
                   f"x {dtype_bytes} B x ({ways}-1)/{ways} (balanced routing; the real figure depends on the routing)")
        return {**common, "exact": False, "formula": formula}
    if cfg.backends.moe == "capacity_dedup":
        k = moe.experts_per_token
        reached, rows = devices_reached(k, ways, moe.num_experts, moe.n_group, moe.topk_group), x.rows
        formula = (f"{head} all-to-alls x {rows} rows ({ways} devices x ceil({reached} devices reached x {tokens} "
                   f"tokens x {cfg.backends.capacity_factor} / {ways})) x d_model={m.d_model} x {dtype_bytes} B x "
                   f"({ways}-1)/{ways}, + {layers} layers x {x.microbatches} microbatches x {x.choices_per_layer} "
                   f"all-to-alls of the rows' k={k} choices ({_whole(x.choice_bytes)} B)")
        return {**common, "exact": True, "formula": formula, "devices_reached": reached, "rows": rows}
    formula = (f"{head} all-to-alls x E={moe.num_experts} x C={int(x.slots)} x d_model={m.d_model} x {dtype_bytes} B "
               f"x ({ways}-1)/{ways}")
    return {**common, "exact": True, "formula": formula}


def _expert_params(engine) -> list[dict[str, Any]]:
    """Parameters whose stored sharding splits a dimension over `expert`: path and PartitionSpec."""
    out = []
    for path, sharding in jax.tree_util.tree_flatten_with_path(engine.state_shardings.params)[0]:
        spec = tuple(sharding.spec)
        if AXIS in spec_axes(sharding.spec):
            out.append({"path": ".".join(str(getattr(k, "key", k)) for k in path),
                        "spec": [list(e) if isinstance(e, tuple) else e for e in spec]})
    return out


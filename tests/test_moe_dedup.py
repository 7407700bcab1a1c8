"""Deduplicated expert dispatch (backends.moe=capacity_dedup): equal to the dense loop, drops reported, fewer bytes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from moe_reference import reference_experts, reference_routing
from test_moe_layer import (
    MESHES,
    _assert_close,
    _compiled_collectives,
    _inputs,
    _layer,
    _layer_value_and_grads,
    _setup,
    assert_layer_equals_the_dense_loop,
)

from spmd_train import load_config, use_layout
from spmd_train.ops.capacity import capacity, device_capacity, devices_reached
from spmd_train.ops.experts import ExpertWeights
from spmd_train.parallel.expert_dispatch import moe_ffn
from tests.runs import ROOT

DEDUP = "backends.moe=capacity_dedup"
GROUPED = ["model.moe.router_score=sigmoid", "model.moe.n_group=4", "model.moe.topk_group=2",
           "model.moe.experts_per_token=4", "model.moe.router_z_weight=0"]
"""Group-limited routing: 8 experts in 4 groups of 2; each token's 4 choices from its 2 best groups."""


@pytest.mark.parametrize("mesh", ["expert8", "expert2_fsdp2_tensor2", "expert2_sequence2_tensor2"])
def test_dedup_layer_and_gradients_equal_the_dense_loop_when_nothing_drops(devices, mesh):
    cfg, layout = _setup(devices, DEDUP, "backends.capacity_factor=8.0", *MESHES[mesh])
    assert_layer_equals_the_dense_loop(cfg, layout)


def test_dedup_equals_the_capacity_path_under_group_limited_routing(devices):
    # Sigmoid scores, groups and a selection bias: the routing is the layer's, and both dispatches run the same
    # choices when nothing drops.
    common = [*GROUPED, "model.moe.bias_update_rate=0.01", "backends.capacity_factor=8.0", *MESHES["expert4"]]
    x, cot = _inputs()
    results = []
    for impl in ("capacity", "capacity_dedup"):
        cfg, layout = _setup(devices, f"backends.moe={impl}", *common)
        graphdef, state = _layer(cfg)
        params = nnx.to_pure_dict(state)
        params["router_bias"] = 0.3 * jax.random.normal(jax.random.key(3), params["router_bias"].shape)
        nnx.replace_by_pure_dict(state, params)
        results.append(_layer_value_and_grads(layout, graphdef, state, x, cot))
    (y, _, (grads, dx)), (y_dedup, stats, (grads_dedup, dx_dedup)) = results
    assert float(stats["dropped_fraction"]) == 0.0
    _assert_close(y_dedup, y, what="output")
    _assert_close(dx_dedup, dx, what="d input")
    for name in ("router", "w_gate", "w_up", "w_down"):
        _assert_close(grads_dedup[name], grads[name], what=f"d {name}")


def _dispatch(devices, overrides, k, factor):
    """(cfg, y, kept, expert_idx, gates, weights, x) of `moe_ffn` with capacity_dedup at `factor` on the layer's
    mesh."""
    cfg, layout = _setup(devices, DEDUP, f"model.moe.experts_per_token={k}", *overrides)
    _, state = _layer(cfg)
    params = nnx.to_pure_dict(state)
    x, _ = _inputs()
    idx, gates = reference_routing(x, params["router"], k)
    w = ExpertWeights(params["w_gate"], params["w_up"], params["w_down"])
    x_sh = NamedSharding(layout.mesh, layout.activation_spec(P("batch", "length", "embed")))

    def run(x, idx, gates, w):
        with use_layout(layout):
            return moe_ffn(x, idx, gates, w, num_experts=cfg.model.moe.num_experts, capacity_factor=factor,
                           impl="capacity_dedup")

    y, kept = jax.jit(run)(jax.device_put(x, x_sh), idx, gates, w)
    return cfg, np.asarray(y), np.asarray(kept), np.asarray(idx), gates, w, x


def test_dropped_choices_are_reported_and_left_out_of_the_output(devices):
    # A factor small enough that device queues and local expert queues both overflow.
    cfg, y, kept, idx, gates, w, x = _dispatch(devices, MESHES["expert8"], 2, 0.5)
    assert 0.2 < 1 - kept.mean() < 0.9
    _assert_close(y, reference_experts(x, idx, gates, w.w_gate, w.w_up, w.w_down, kept=jnp.asarray(kept)),
                  what="output of the kept choices")
    np.testing.assert_array_equal(kept, _reference_dedup_kept(idx, cfg.mesh.expert, 8, 0.5))


def _reference_dedup_kept(idx: np.ndarray, ways: int, num_experts: int, factor: float) -> np.ndarray:
    """The drop rule written out: per group (a device's rows), each token's rows to the devices holding its choices
    queue in token order; each device then queues the choices it received, choice-major over its rows taken source
    by source, into its experts' slots."""
    b, l, k = idx.shape
    groups = idx.reshape(ways, b // ways * l, k)  # expert8: each device holds b / 8 rows
    tokens, per = groups.shape[1], num_experts // ways
    rows = device_capacity(k, tokens, factor, ways, num_experts)
    slots = capacity(k, tokens * ways, factor, num_experts)
    sent = np.zeros((ways, tokens, ways), bool)  # [source, token, destination]
    received = [[] for _ in range(ways)]  # per destination: (source, token) in row order
    for src in range(ways):
        used = np.zeros(ways, int)
        for t in range(tokens):
            for dst in sorted({int(e) // per for e in groups[src, t]}):
                if used[dst] < rows:
                    sent[src, t, dst] = True
                    used[dst] += 1
    for dst in range(ways):
        for src in range(ways):
            received[dst] += [(src, t) for t in range(tokens) if sent[src, t, dst]]
    kept = np.zeros((ways, tokens, k), bool)
    for dst in range(ways):
        used = np.zeros(per, int)
        for j in range(k):  # choice-major over the received rows
            for src, t in received[dst]:
                e = int(groups[src, t, j])
                if e // per == dst and used[e % per] < slots:
                    kept[src, t, j] = True
                    used[e % per] += 1
    return kept.reshape(b, l, k)


def test_dedup_moves_the_rows_group_limited_routing_bounds(devices):
    # expert 4 holds 2 experts a device, one group of 2 each: a token's 4 choices from its 2 best groups reach at
    # most 2 of the 4 devices, and the all-to-all carries one row per (token, device) instead of one per choice.
    mesh = ["mesh.expert=4", "mesh.fsdp=2"]
    _, coll = _compiled_collectives(devices, [*GROUPED, DEDUP, *mesh], backward=False)
    _, plain = _compiled_collectives(devices, [*GROUPED, *mesh], backward=False)
    tokens = 16  # a device's group: one row of 16 tokens
    assert devices_reached(4, 4, 8, 4, 2) == 2
    rows = 4 * device_capacity(4, tokens, 1.25, 4, 8, 4, 2)  # 10 to each of the 4 devices
    a2a = [c for c in coll if c.op == "all-to-all"]
    # Out: a row of D floats and its 4 choices (local expert and gate, 4 bytes each); back: the row. (The choices'
    # flags come back too when the dropped fraction is used: it is not here, so XLA drops that exchange.)
    assert [(c.axes, c.count) for c in a2a] == [(("expert",), 4)]
    assert a2a[0].bytes == pytest.approx(rows * (2 * 64 * 4 + 4 * (4 + 4)) * 3 / 4)
    slots = 8 * capacity(4, tokens, 1.25, 8)  # the capacity path: every expert's slots, one row per choice
    assert sum(c.bytes for c in plain if c.op == "all-to-all") == pytest.approx(slots * 64 * 4 * 2 * 3 / 4)
    assert a2a[0].bytes < 0.55 * slots * 64 * 4 * 2 * 3 / 4


@pytest.mark.parametrize("remat", ["none", "full"])
def test_describe_counts_the_compiled_dedup_exchanges(devices, remat):
    # configs/moe.yaml (expert 4 x fsdp 2, 2 experts a device) with 4 groups of 2 and top-1 group: each token's 2
    # choices lie on one device, so one row per token crosses where the capacity path sends two.
    from spmd_train.analysis import describe

    cfg = load_config(ROOT / "configs" / "moe.yaml", ["run.simulate_devices=null", DEDUP, "model.moe.n_group=4",
                                                      "model.moe.topk_group=1", f"parallel.remat={remat}"])
    report = describe(cfg, devices=list(devices)).to_json()
    moe = report["moe"]["all_to_all"]
    (a2a,) = [c for c in report["collectives"] if c["op"] == "all-to-all"]
    assert moe["devices_reached"] == 1 and moe["rows"] == 4 * device_capacity(2, 4 * 64, 1.25, 4, 8, 4, 1)
    assert a2a["count"] == moe["count"] and abs(a2a["bytes"] - moe["bytes_per_device"]) <= 1e-6 * a2a["bytes"]


def test_dedup_training_steps_equal_one_device(devices):
    # configs/moe.yaml's train step, group-limited, nothing dropped: three steps on expert 4 x fsdp 2 as on one device.
    from test_moe_model import NO_DROPS, ONE_DEVICE, _assert_same_run, _train

    common = [NO_DROPS, DEDUP, "model.moe.n_group=4", "model.moe.topk_group=2"]
    _assert_same_run(_train(common, devices, 3), _train([*common, *ONE_DEVICE], devices[:1], 3))

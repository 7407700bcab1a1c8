"""Mixture-of-experts layer: equivalence with a dense loop, dropping, router losses, all-to-all structure."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# Imported by file name (tests/ is on sys.path under plain `pytest` as well as `python -m pytest`).
from moe_reference import (
    emulated_ragged_all_to_all,
    reference_experts,
    reference_kept,
    reference_moe,
    reference_router_losses,
    reference_routing,
)

from spmd_train import ConfigError, Layout, build_mesh, load_config, use_layout
from spmd_train.analysis import collectives_of
from spmd_train.analysis.topology import tpu_topology_devices
from spmd_train.config.checks import check_moe
from spmd_train.models.moe import MoE
from spmd_train.ops.capacity import capacity
from spmd_train.ops.experts import ExpertWeights
from spmd_train.ops.routing import aux_loss, route, slot_positions, z_loss
from spmd_train.parallel import resolve_backends
from spmd_train.parallel.expert_dispatch import moe_ffn
from tests.runs import abstract_like
from tests.tiers import fast_cases

BATCH, LENGTH, D = 8, 16, 64
AUX, Z = 0.3, 0.1  # weights of the router losses in the test objective, large enough to matter
BASE = ["model.preset=tiny", "model.moe.every=1", "model.init_std=0.1", "parallel.zero_stage=3"]


def _setup(devices, *overrides):
    cfg = load_config(None, [*BASE, *overrides])
    return cfg, Layout.from_config(cfg, build_mesh(cfg.mesh, devices))


def _backends(cfg):
    """The implementations the engine would choose on a CPU (the layer tests build the layer alone)."""
    return resolve_backends(cfg.model, cfg.backends, "cpu")


def _layer(cfg, seed=0):
    graphdef, state = nnx.split(MoE(cfg.model, nnx.Rngs(seed), _backends(cfg)))
    return graphdef, state


def _bind(graphdef, state, params):
    """The layer with its parameters replaced by `params` (a pure dict), leaving `state` untouched."""
    fresh = jax.tree.map(lambda v: v, state)
    nnx.replace_by_pure_dict(fresh, params)
    return nnx.merge(graphdef, fresh)


def _logical(state):
    return nnx.to_pure_dict(jax.tree.map(lambda v: v.get_metadata()["logical_axes"], state,
                                         is_leaf=lambda x: isinstance(x, nnx.Variable)))


def _inputs(seed=1):
    kx, kc = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (BATCH, LENGTH, D)), jax.random.normal(kc, (BATCH, LENGTH, D))


def _layer_value_and_grads(layout, graphdef, state, x, cot):
    """y, stats and d(sum(y * cot) + router losses)/d(params, x), jitted under `layout` (None: unsharded)."""
    params = nnx.to_pure_dict(state)
    if layout is not None:
        params = jax.device_put(params, layout.param_shardings(_logical(state), params))
        x = jax.device_put(x, NamedSharding(layout.mesh, layout.activation_spec(P("batch", "length", "embed"))))

    def loss(params, x):
        with use_layout(layout):
            y, stats = _bind(graphdef, state, params)(x)
        return jnp.sum(y * cot) + AUX * stats["aux_loss"] + Z * stats["z_loss"], (y, stats)

    (_, (y, stats)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return y, stats, grads


@functools.partial(jax.jit, static_argnums=(3, 4))
def _reference_value_and_grads(params, x, cot, k, limit=None):
    def loss(params, x):
        y = reference_moe(params, x, k, limit=limit)
        aux, z = reference_router_losses(x, params["router"], k, params.get("router_logit_bias"))
        return jnp.sum(y * cot) + AUX * aux + Z * z, y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return y, grads


def _assert_close(actual, expected, rel=1e-5, what=""):
    actual, expected = np.asarray(actual), np.asarray(expected)
    err, scale = np.max(np.abs(actual - expected)), np.max(np.abs(expected))
    assert err <= rel * scale, f"{what}: max error {err:.3g} > {rel} x max |expected| {scale:.3g}"


# --- equivalence with the dense loop ------------------------------------------------------------------

MESHES = {
    "single": None,
    "expert1": ["mesh.expert=1"],
    "expert2": ["mesh.expert=2"],
    "expert4": ["mesh.expert=4"],
    "expert8": ["mesh.expert=8", "mesh.fsdp=1"],
    "expert2_fsdp2_tensor2": ["mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"],
    "expert4_tensor2": ["mesh.expert=4", "mesh.fsdp=1", "mesh.tensor=2"],
    "expert1_tensor2": ["mesh.expert=1", "mesh.tensor=2"],
    "expert2_fsdp2_tensor2_zero1": ["mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.zero_stage=1"],
    # Context parallelism: each device routes its part of the length (in a region even without exchange).
    "expert1_sequence2": ["mesh.expert=1", "mesh.sequence=2"],
    "expert2_sequence2_tensor2": ["mesh.expert=2", "mesh.fsdp=1", "mesh.sequence=2", "mesh.tensor=2"],
}
CASES = [(m, k) for m in ("single", "expert1", "expert2", "expert4", "expert8") for k in (1, 2)] + [
    ("expert2_fsdp2_tensor2", 2), ("expert4_tensor2", 2), ("expert4_tensor2", 1), ("expert1_tensor2", 2),
    ("expert2_fsdp2_tensor2_zero1", 2), ("expert1_sequence2", 2), ("expert2_sequence2_tensor2", 2),
]


@pytest.mark.parametrize(("mesh", "k"), fast_cases(
    CASES, fast=["single-2", "expert8-1", "expert2_fsdp2_tensor2-2", "expert2_sequence2_tensor2-2"],
    ids=lambda case: f"{case[0]}-{case[1]}", several=True))
def test_layer_and_gradients_equal_the_dense_loop_when_nothing_drops(devices, mesh, k):
    # capacity_factor = num_experts gives k x tokens slots per expert: nothing can drop.
    cfg, layout = _setup(devices, f"model.moe.experts_per_token={k}", "backends.capacity_factor=8.0",
                         *(MESHES[mesh] or []))
    assert_layer_equals_the_dense_loop(cfg, None if MESHES[mesh] is None else layout, k)


def assert_layer_equals_the_dense_loop(cfg, layout, k: int = 2) -> None:
    """The MoE layer of `cfg` under `layout` (None: unsharded), its output and gradients, equal to the dense loop's,
    with nothing dropped."""
    graphdef, state = _layer(cfg)
    x, cot = _inputs()
    y, stats, (grads, dx) = _layer_value_and_grads(layout, graphdef, state, x, cot)
    y_ref, (grads_ref, dx_ref) = _reference_value_and_grads(nnx.to_pure_dict(state), x, cot, k)
    assert float(stats["dropped_fraction"]) == 0.0
    _assert_close(y, y_ref, what="output")
    _assert_close(dx, dx_ref, what="d input")
    for name in ("router", "w_gate", "w_up", "w_down"):
        _assert_close(grads[name], grads_ref[name], what=f"d {name}")


GPT_OSS = ["model.moe.router_logit_bias=true", "model.moe.expert_bias=true", "model.moe.swiglu_limit=0.5"]
"""gpt-oss's MoE, its clamp at 0.5 so that it binds for these inputs (gpt-oss itself: 7)."""


@pytest.mark.parametrize(("mesh", "impl"), fast_cases(
    [("single", "capacity"), ("expert2_fsdp2_tensor2", "capacity"), ("single", "dropless"),
     ("expert2_fsdp2_tensor2", "dropless")], fast=["expert2_fsdp2_tensor2-capacity", "expert2_fsdp2_tensor2-dropless"],
    ids=lambda case: "-".join(case), several=True))
def test_gpt_oss_biases_and_clamped_swiglu_equal_the_dense_loop(devices, monkeypatch, mesh, impl):
    # Router and expert biases drawn away from their zero start; the down bias is added once after the hidden
    # width's reduction over `tensor`, and each ragged row takes its own expert's biases.
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    cfg, layout = _setup(devices, *GPT_OSS, f"backends.moe={impl}", "backends.capacity_factor=8.0",
                         *(MESHES[mesh] or []))
    graphdef, state = _layer(cfg)
    params = nnx.to_pure_dict(state)
    keys = iter(jax.random.split(jax.random.key(7), 4))
    for name in ("router_logit_bias", "b_gate", "b_up", "b_down"):
        params[name] = 0.5 * jax.random.normal(next(keys), params[name].shape)
    nnx.replace_by_pure_dict(state, params)
    x, cot = _inputs()
    y, stats, (grads, dx) = _layer_value_and_grads(None if MESHES[mesh] is None else layout, graphdef, state, x, cot)
    y_ref, (grads_ref, dx_ref) = _reference_value_and_grads(params, x, cot, 2, 0.5)
    plain, _ = _reference_value_and_grads({k: v for k, v in params.items() if k in ("router", "w_gate", "w_up",
                                                                                   "w_down")}, x, cot, 2)
    assert np.abs(np.asarray(y_ref - plain)).max() > 0.1 * np.abs(np.asarray(plain)).max()  # the variant matters
    assert float(stats["dropped_fraction"]) == 0.0
    _assert_close(y, y_ref, what="output")
    _assert_close(dx, dx_ref, what="d input")
    for name in ("router", "router_logit_bias", "w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down"):
        _assert_close(grads[name], grads_ref[name], what=f"d {name}")


@pytest.mark.slow
def test_shared_experts_add_a_dense_swiglu(devices):
    cfg, layout = _setup(devices, "model.moe.num_shared_experts=2", "model.moe.d_ff=32", "backends.capacity_factor=8.0",
                         "mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2")
    graphdef, state = _layer(cfg)
    x, cot = _inputs()
    y, _, _ = _layer_value_and_grads(layout, graphdef, state, x, cot)
    p = nnx.to_pure_dict(state)
    assert p["shared_gate"].shape == (D, 64)
    shared = (jax.nn.silu(x @ p["shared_gate"]) * (x @ p["shared_up"])) @ p["shared_down"]
    _assert_close(y, jax.jit(reference_moe, static_argnums=2)(p, x, 2) + shared, what="output")


@pytest.mark.parametrize("impl", fast_cases(["capacity", "dropless"], fast=["dropless"]))
def test_bfloat16_compute_stays_close_to_the_fp32_loop(devices, monkeypatch, impl):
    # Also guards an XLA:CPU abort on bf16 psum / psum_scatter in a partly manual shard_map.
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    cfg, layout = _setup(devices, "model.compute_dtype=bfloat16", "backends.capacity_factor=8.0",
                         f"backends.moe={impl}", "mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2")
    graphdef, state = _layer(cfg)
    x, cot = _inputs()
    x = x.astype(jnp.bfloat16)
    y, _, (grads, _) = _layer_value_and_grads(layout, graphdef, state, x, cot)
    y_ref, (grads_ref, _) = _reference_value_and_grads(nnx.to_pure_dict(state), x.astype(jnp.float32), cot, 2)
    assert y.dtype == jnp.bfloat16
    _assert_close(y.astype(jnp.float32), y_ref, rel=3e-2, what="output")
    _assert_close(grads["w_down"], grads_ref["w_down"], rel=3e-2, what="d w_down")


def test_stacked_layer_parameters_carry_a_layers_axis():
    cfg = load_config(None, [*BASE, "model.moe.num_shared_experts=1"])
    _, state = nnx.split(nnx.eval_shape(lambda: MoE(cfg.model, nnx.Rngs(0), _backends(cfg), stack=3)))
    logical, shapes = _logical(state), nnx.to_pure_dict(state)
    assert shapes["w_gate"].shape == (3, 8, D, 128) and shapes["w_down"].shape == (3, 8, 128, D)
    assert tuple(logical["w_gate"]) == ("layers", "experts", "embed", "expert_mlp")
    assert tuple(logical["router"]) == ("layers", "embed", "router_experts")
    assert tuple(logical["shared_down"]) == ("layers", "mlp", "embed")


# --- dropping -----------------------------------------------------------------------------------------


def _crafted_routing(num_experts, k, seed=0):
    """Skewed routing: most assignments go to experts 0 and 1, so small capacities overflow."""
    rng = np.random.default_rng(seed)
    p = np.array([0.4, 0.3] + [0.3 / (num_experts - 2)] * (num_experts - 2))
    idx = np.stack([rng.choice(num_experts, size=k, replace=False, p=p) for _ in range(BATCH * LENGTH)])
    gates = rng.uniform(0.1, 1.0, size=idx.shape)
    gates = (gates / gates.sum(-1, keepdims=True)).astype(np.float32)
    return idx.reshape(BATCH, LENGTH, k).astype(np.int32), gates.reshape(BATCH, LENGTH, k)


@pytest.mark.parametrize(("mesh", "groups"), [(None, 1), (["mesh.expert=4", "mesh.fsdp=2"], 8),
                                              (["mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"], 4)])
def test_dropped_assignments_match_first_choices_first_in_token_order(devices, mesh, groups):
    cfg, layout = _setup(devices, *(mesh or []))
    layout = layout if mesh else None
    _graphdef, state = _layer(cfg)
    p = nnx.to_pure_dict(state)
    x, _ = _inputs()
    idx, gates = _crafted_routing(8, 2)
    factor = 0.5
    slots = capacity(2, BATCH * LENGTH // groups, factor, 8)

    def run(x, idx, gates, w):
        with use_layout(layout):
            return moe_ffn(x, idx, gates, w, num_experts=8, capacity_factor=factor)

    w = ExpertWeights(p["w_gate"], p["w_up"], p["w_down"])
    y, kept = jax.jit(run)(x, jnp.asarray(idx), jnp.asarray(gates), w)
    want = reference_kept(idx, 8, slots, groups)
    assert 0 < (~want).sum() < want.size
    np.testing.assert_array_equal(np.asarray(kept), want)
    _assert_close(y, reference_experts(x, idx, gates, p["w_gate"], p["w_up"], p["w_down"], want), what="output")
    fully_dropped = ~want.any(-1)
    assert fully_dropped.any()
    assert np.all(np.asarray(y)[fully_dropped] == 0.0)


def test_dropped_fraction_stat_matches_the_reference_queues(devices):
    cfg, layout = _setup(devices, "backends.capacity_factor=0.5", "mesh.expert=4", "mesh.fsdp=2")
    graphdef, state = _layer(cfg)
    x, cot = _inputs()
    _, stats, _ = _layer_value_and_grads(layout, graphdef, state, x, cot)
    idx, _ = reference_routing(x, nnx.to_pure_dict(state)["router"], 2)
    want = reference_kept(np.asarray(idx), 8, capacity(2, LENGTH, 0.5, 8), 8)
    assert float(stats["dropped_fraction"]) == pytest.approx(1 - want.mean())
    np.testing.assert_array_equal(np.asarray(stats["expert_load"]), np.bincount(np.asarray(idx).ravel(), minlength=8))


def test_capacity_rounds_up():
    assert capacity(2, 16, 1.25, 8) == 5
    assert capacity(1, 10, 1.0, 4) == 3  # 2.5 -> 3
    assert capacity(2, 128, 0.01, 8) == 1


def test_slot_positions_fill_first_choices_before_second_choices():
    idx = jnp.array([[0, 1], [1, 0], [0, 1]])
    np.testing.assert_array_equal(slot_positions(idx, 2), [[0, 1], [0, 2], [1, 2]])


# --- router and its losses ----------------------------------------------------------------------------


def test_route_takes_top_k_and_renormalises_gates():
    logits = jnp.log(jnp.array([[0.1, 0.5, 0.15, 0.25]]))
    idx, gates, probs = route(logits, 2)
    np.testing.assert_array_equal(idx, [[1, 3]])
    np.testing.assert_allclose(gates, [[0.5 / 0.75, 0.25 / 0.75]], rtol=1e-6)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)
    idx, gates, _ = route(logits, 2, "sigmoid")
    np.testing.assert_array_equal(idx, [[1, 3]])
    np.testing.assert_allclose(gates.sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_aux_loss_is_k_under_uniform_routing_and_grows_with_imbalance(k):
    e = 8
    # Token t prefers experts t, t+1, ..., t+k-1 (mod E) equally: every expert is chosen by the same
    # number of tokens, and the mean router probability (a cyclic shift per token) is exactly 1/E.
    logits = 3.0 * sum(jax.nn.one_hot((jnp.arange(e) + j) % e, e) for j in range(k))
    idx, _, probs = route(logits, k)
    assert float(aux_loss(probs, idx)) == pytest.approx(k, rel=1e-6)
    # Move the first m tokens' choices onto experts 0..k-1: the loss grows with m.
    losses = []
    for m in (2, 4, 8):
        idx_m, _, probs_m = route(logits.at[:m, :k].add(6.0), k)
        losses.append(float(aux_loss(probs_m, idx_m)))
    assert k < losses[0] < losses[1] < losses[2]


def test_z_loss_is_the_mean_squared_logsumexp():
    logits = np.random.default_rng(0).normal(size=(4, 16, 8)).astype(np.float32) * 3
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    assert float(z_loss(jnp.asarray(logits))) == pytest.approx(np.mean(lse ** 2), rel=1e-5)


# --- structure: all-to-all over `expert` ------------------------------------------------------------


def _compiled_collectives(devices, overrides, *, backward):
    cfg, layout = _setup(devices, "backends.capacity_factor=1.25", *overrides)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(cfg.model, nnx.Rngs(0), _backends(cfg))))
    shapes = nnx.to_pure_dict(state)
    shardings = layout.param_shardings(_logical(state), shapes)
    x_sh = NamedSharding(layout.mesh, layout.activation_spec(P("batch", "length", "embed")))

    def forward(params, x):
        with use_layout(layout):
            y, stats = _bind(graphdef, state, params)(x)
        return y, stats

    def fn(params, x):
        if not backward:
            return forward(params, x)[0]
        return jax.grad(lambda p, x: jnp.sum(forward(p, x)[0]), argnums=(0, 1))(params, x)

    params = abstract_like(shapes, shardings)
    x = jax.ShapeDtypeStruct((BATCH, LENGTH, D), jnp.float32, sharding=x_sh)
    compiled = jax.jit(fn).lower(params, x).compile()
    return cfg, collectives_of(compiled.as_text(), layout.mesh)


@pytest.mark.parametrize("mesh", [["mesh.expert=8", "mesh.fsdp=1"], ["mesh.expert=4", "mesh.fsdp=2"],
                                  ["mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"]])
@pytest.mark.parametrize("backward", [False, True])
def test_one_all_to_all_each_way_per_layer_with_slot_bytes(devices, mesh, backward):
    cfg, coll = _compiled_collectives(devices, mesh, backward=backward)
    a2a = [c for c in coll if c.op == "all-to-all"]
    assert [(c.axes, c.count) for c in a2a] == [(("expert",), 4 if backward else 2)]
    n = cfg.mesh.expert
    rows = BATCH // (n * cfg.mesh.fsdp)
    slots = cfg.model.moe.num_experts * capacity(2, rows * LENGTH, 1.25, cfg.model.moe.num_experts)
    assert a2a[0].group_size == n
    assert a2a[0].bytes == pytest.approx(a2a[0].count * slots * D * 4 * (n - 1) / n)


# --- dropless -----------------------------------------------------------------------------------------


def test_dropless_single_device_equals_the_dense_loop(devices):
    cfg, _ = _setup(devices, "backends.moe=dropless", "backends.capacity_factor=0.1")
    assert_layer_equals_the_dense_loop(cfg, None)


@pytest.mark.parametrize("mesh", [["mesh.expert=1"], ["mesh.expert=2"], ["mesh.expert=8", "mesh.fsdp=1"],
                                  ["mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"]])
def test_dropless_exchange_equals_the_dense_loop_with_an_emulated_ragged_all_to_all(devices, monkeypatch, mesh):
    # XLA:CPU cannot run ragged_all_to_all; an all_gather emulation of its documented semantics
    # checks the offsets and sizes this layer computes (the TPU test below checks the real op compiles).
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    cfg, layout = _setup(devices, "backends.moe=dropless", *mesh)
    graphdef, state = _layer(cfg)
    x, cot = _inputs()
    y, _stats, (grads, dx) = _layer_value_and_grads(layout, graphdef, state, x, cot)
    y_ref, (grads_ref, dx_ref) = _reference_value_and_grads(nnx.to_pure_dict(state), x, cot, 2)
    _assert_close(y, y_ref, what="output")
    _assert_close(dx, dx_ref, what="d input")
    for name in ("router", "w_gate", "w_up", "w_down"):
        _assert_close(grads[name], grads_ref[name], what=f"d {name}")


@pytest.mark.tpu_aot
@pytest.mark.parametrize("mesh", [["mesh.expert=8", "mesh.fsdp=1"], ["mesh.expert=4", "mesh.fsdp=2"]])
def test_dropless_compiles_for_tpu_with_ragged_all_to_all(mesh):
    devices = tpu_topology_devices("v5e:2x4")
    cfg, layout = _setup(devices, "backends.moe=dropless", *mesh)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(cfg.model, nnx.Rngs(0), _backends(cfg))))
    shapes = nnx.to_pure_dict(state)
    shardings = layout.param_shardings(_logical(state), shapes)

    def loss(params, x):
        with use_layout(layout):
            return jnp.sum(_bind(graphdef, state, params)(x)[0])

    params = abstract_like(shapes, shardings)
    x = jax.ShapeDtypeStruct((BATCH, LENGTH, D), jnp.float32, sharding=NamedSharding(
        layout.mesh, layout.activation_spec(P("batch", "length", "embed"))))
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile().as_text()
    # There and back in the forward pass, and their transposes in the backward pass.
    assert len(re.findall(r" ragged-all-to-all\(", hlo)) == 4


# --- config checks ------------------------------------------------------------------------------------

SIZES = {"data": 1, "pipeline": 1, "fsdp": 2, "sequence": 1, "expert": 4, "tensor": 1}


@pytest.mark.parametrize(("overrides", "sizes", "platform", "names"), [
    (["model.moe.num_experts=6"], SIZES, "gpu", ["num_experts=6", "mesh.expert=4", "1, 2, 3, 6"]),
    (["model.moe.experts_per_token=9"], SIZES, "gpu", ["experts_per_token=9", "num_experts=8", "1 to 8"]),
    (["model.moe.every=3"], SIZES, "gpu", ["model.moe.every=3", "num_layers=2", "valid: 1, 2", "model.moe=null"]),
    (["backends.moe=dropless"], SIZES, "cpu", ["backends.moe=dropless", "XLA:CPU", "backends.moe=capacity",
                                               "--topology"]),
])
def test_check_moe_names_the_values_and_what_is_valid(overrides, sizes, platform, names):
    cfg = load_config(None, ["model.preset=tiny", "model.moe.every=1", *overrides])
    with pytest.raises(ConfigError) as err:
        check_moe(cfg, sizes, platform)
    for name in names:
        assert name in str(err.value)


def test_check_moe_accepts_a_valid_layout_and_ignores_moe_keys_when_off():
    cfg = load_config(None, ["model.preset=tiny", "model.moe.every=2", "backends.moe=dropless"])
    check_moe(cfg, SIZES, "tpu")
    off = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=None))
    check_moe(off, SIZES, "cpu")


def test_a_z_loss_on_a_sigmoid_router_is_allowed_with_a_warning(caplog):
    sigmoid = ["model.preset=tiny", "model.moe.every=2", "model.moe.router_score=sigmoid"]
    with caplog.at_level("WARNING", logger="spmd_train"):
        check_moe(load_config(None, sigmoid), SIZES, "tpu")
        check_moe(load_config(None, [*sigmoid, "model.moe.router_z_weight=0"]), SIZES, "tpu")
        check_moe(load_config(None, ["model.preset=tiny", "model.moe.every=2"]), SIZES, "tpu")  # softmax: its default
    (warned,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "model.moe.router_z_weight=0.001 with model.moe.router_score=sigmoid" in warned
    assert "(model.moe.router_z_weight=0 to match it)" in warned


@pytest.mark.parametrize(("override", "needles"), [
    ("model.moe.experts_per_token=0", ["model.moe.experts_per_token=0", "greater than or equal to 1"]),
    ("model.moe.every=0", ["model.moe.every=0", "greater than or equal to 1"]),
    ("model.moe.num_shared_experts=-1", ["model.moe.num_shared_experts=-1", "greater than or equal to 0"]),
    ("backends.capacity_factor=0.0", ["backends.capacity_factor=0.0", "greater than 0"]),
    ("model.moe_every=2", ["'model.moe_every' has moved", "model.moe.every", "model.moe=null"]),
    ("model.capacity_factor=2.0", ["'model.capacity_factor' has moved", "backends.capacity_factor"]),
])
def test_single_moe_key_ranges_and_moved_keys_are_schema_errors(override, needles):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.preset=tiny", "model.moe.every=1", override])
    for needle in needles:
        assert needle in str(err.value)

"""Mixture-of-experts models end to end: equivalence, compiled structure, metrics, training, CLI, describe."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest

from spmd_train import Engine, Trainer, load_config
from spmd_train.analysis import collectives_of
from spmd_train.analysis.context_report import compiled_over_sequence, context_section
from spmd_train.analysis.moe_report import moe_section
from spmd_train.analysis.topology import has_libtpu, tpu_topology_devices
from spmd_train.config.resolved_rules import resolve_rules
from spmd_train.data import make_source
from spmd_train.ops.capacity import capacity
from tests.runs import ROOT, cli, optimized_step, relative_error, tensorboard_events
from tests.tiers import fast_cases

CONFIG = ROOT / "configs" / "moe.yaml"
NO_DROPS = "backends.capacity_factor=8.0"  # >= num_experts / k: an expert can take every token of its group
ONE_DEVICE = ["mesh.expert=1", "mesh.fsdp=1"]
MESHES = {
    "expert4_fsdp2": [],  # as configs/moe.yaml has it
    "expert2_fsdp2_tensor2": ["mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"],
    # Replica axes (manual in the gradient step): routing fractions are averaged over them.
    "data2_expert4_replicas": ["mesh.data=2", "mesh.fsdp=1"],
    "expert4_fsdp2_zero1_replicas": ["parallel.zero_stage=1"],
    # Context parallelism: each device routes its part of every row (zigzag chunks under ring).
    "sequence2_data2_expert2_ring": ["mesh.data=2", "mesh.fsdp=1", "mesh.expert=2", "mesh.sequence=2",
                                     "parallel.context_parallel=ring"],
}
MOE_METRICS = ("aux_loss", "z_loss", "dropped_fraction", "expert_load.0", "expert_load.1")


def _train(overrides, devices, steps, optimized=False):
    """`steps` optimizer steps of configs/moe.yaml; returns (per-step metrics as floats, final params, engine).
    `optimized`: the step compiled by XLA:CPU's optimizing backend, for runs of a hundred steps and more."""
    cfg = load_config(CONFIG, list(overrides))
    engine = Engine.build(cfg, list(devices))
    state, data = engine.init_state(), make_source(cfg)
    step_fn = optimized_step(engine, state, data) if optimized else engine.train_step
    history, pending = [], None
    for step in range(steps):
        state, metrics = step_fn(state, data.batch(step, engine.batch_sharding))
        if pending is not None:  # one step in flight at most (XLA:CPU collectives on 8 simulated devices)
            history.append({k: float(v) for k, v in jax.device_get(pending).items() if k != "histograms"})
        pending = metrics
    history.append({k: float(v) for k, v in jax.device_get(pending).items() if k != "histograms"})
    return history, jax.tree.map(np.asarray, state.params), engine


@pytest.fixture(scope="module")
def one_device(devices):
    return _train([NO_DROPS, *ONE_DEVICE], devices[:1], 3)


# --- (a) equivalence with one device ---------------------------------------------------------------


def _assert_same_run(run, reference):
    history, params, _ = run
    ref_history, ref_params, _ = reference
    # The router statistics too: the sharded step aggregates them over the whole batch like one device.
    for key in ("loss", "grad_norm", *MOE_METRICS):
        np.testing.assert_allclose([h[key] for h in history], [h[key] for h in ref_history], rtol=1e-5, err_msg=key)
    assert relative_error(params, ref_params) < 1e-5


@pytest.mark.parametrize("mesh", fast_cases(MESHES, fast=["expert2_fsdp2_tensor2"]))
def test_sharded_steps_equal_one_device(devices, one_device, mesh):
    # Without grad accumulation the aux loss is the whole batch's on every mesh, replicas included.
    _assert_same_run(_train([NO_DROPS, *MESHES[mesh]], devices, 3), one_device)


# --- (c) metrics ------------------------------------------------------------------------------------


def test_step_metrics_report_every_moe_layer_plausibly(one_device):
    # The sharded runs report the same values (test_sharded_steps_equal_one_device).
    history, _, engine = one_device
    m = engine.cfg.model
    assert set(MOE_METRICS) <= set(history[0])
    assert "expert_load.2" not in history[0]  # moe-tiny: 4 layers, every 2nd an MoE layer
    for h in history:
        # Near-uniform routing at init: aux ~ k (its value under uniform routing), z ~ log(E)^2
        # (router logits ~ 0), max/mean load between 1 and its bound E / k.
        assert m.moe.experts_per_token * 0.95 < h["aux_loss"] < m.moe.experts_per_token * 1.25
        assert h["z_loss"] == pytest.approx(math.log(m.moe.num_experts) ** 2, rel=0.1)
        assert h["dropped_fraction"] == 0.0  # capacity factor 8
        for i in range(2):
            assert 1.0 <= h[f"expert_load.{i}"] <= m.moe.num_experts / m.moe.experts_per_token
            assert h[f"expert_load.{i}"] > 1.0  # 4096 assignments never split exactly evenly here


@pytest.mark.slow
def test_trainer_writes_moe_metrics_and_per_expert_histograms(tmp_path, devices):
    cfg = load_config(CONFIG, ["train.steps=3", f"run.dir={tmp_path}", "checkpoint.every=0",
                               "checkpoint.async_save=false", "model.moe.bias_update_rate=0.01", "run.log_every=2"])
    trainer = Trainer(cfg, devices)
    trainer.run()
    trainer.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert set(MOE_METRICS) <= set(r)
        assert 0.0 <= r["dropped_fraction"] < 0.2  # capacity factor 1.25, near-uniform routing
        assert 1.0 < r["expert_load.0"] <= 4.0 and 1.0 < r["expert_load.1"] <= 4.0
        assert r["aux_loss"] == pytest.approx(2.0, rel=0.1) and r["z_loss"] > 0
    # The notebook API's per-expert vectors of the last step, in agreement with its scalars.
    load, bias = trainer.expert_balance["expert_load"], trainer.expert_balance["router_bias"]
    assert load.shape == bias.shape == (2, 8)
    np.testing.assert_allclose(load.sum(-1), 1.0, rtol=1e-6)
    for i in range(2):
        assert load[i].max() / load[i].mean() == pytest.approx(records[-1][f"expert_load.{i}"], rel=1e-5)
        assert np.ptp(bias[i]) == pytest.approx(records[-1][f"router_bias.{i}"], rel=1e-5)
        # Three moves of the rate by the sign of each expert's load error: multiples of 0.01 within 0.03.
        steps = bias[i] / 0.01
        np.testing.assert_allclose(steps, np.round(steps), atol=1e-4)
        assert 0 < np.abs(steps).max() <= 3 + 1e-4
    # TensorBoard: one histogram per MoE layer and vector on the logged steps (1, every 2nd, the last).
    histograms = {(v.tag, e.step): v.histo for e in tensorboard_events(tmp_path) for v in e.summary.value
                  if v.HasField("histo")}
    assert sorted({step for _, step in histograms}) == [1, 2, 3]
    assert {tag for tag, _ in histograms} == {f"train/{n}.{i}" for n in ("expert_load", "router_bias") for i in (0, 1)}
    last = histograms[("train/expert_load.1", 3)]
    assert last.num == 8 and last.sum == pytest.approx(1.0) and last.max == pytest.approx(load[1].max())


# --- (b) structure: all-to-alls of the compiled train step, and the describe section ------------------


def _compiled_collectives(engine):
    state = engine.abstract_state()
    t = engine.cfg.train
    tokens = jax.ShapeDtypeStruct((t.global_batch_size, t.seq_len + 1), "int32", sharding=engine.batch_sharding)
    return collectives_of(engine.train_step.lower(state, tokens).compile().as_text(), engine.mesh)


STRUCTURE = {
    "expert4_fsdp2": ([], 4, 1),
    "expert2_fsdp2_tensor2": (MESHES["expert2_fsdp2_tensor2"], 4, 1),
    # `data` replicas run in the gradient step's manual region; the MoE region nests inside it.
    "data2_expert2_fsdp2": (["mesh.data=2", "mesh.expert=2", "mesh.fsdp=2"], 4, 1),
    # Any remat policy reruns the forward all-to-alls in the backward pass; microbatches each exchange.
    "expert4_fsdp2_accum2_remat": (["train.grad_accum=2", "parallel.remat=full"], 6, 2),
    # Context parallelism: a group is a device's half of its rows; tokens are never gathered over sequence.
    "sequence2_expert2_fsdp2": (["mesh.expert=2", "mesh.fsdp=2", "mesh.sequence=2"], 4, 1),
}


@pytest.mark.parametrize("case", fast_cases(STRUCTURE, fast=["expert2_fsdp2_tensor2"]))
def test_train_step_has_four_all_to_alls_per_moe_layer_with_slot_bytes(devices, case):
    overrides, per_layer, accum = STRUCTURE[case]
    engine = Engine.build(load_config(CONFIG, overrides), devices)
    cfg, mesh = engine.cfg, engine.mesh
    m, t, n = cfg.model, cfg.train, mesh.shape["expert"]
    collectives = _compiled_collectives(engine)
    a2a = [c for c in collectives if c.op == "all-to-all"]
    moe_layers = m.num_layers // m.moe_every
    # One group = the tokens one device holds of a microbatch (batch split over data x fsdp x expert,
    # length over sequence).
    rows = t.global_batch_size // (accum * mesh.shape["data"] * mesh.shape["fsdp"] * n)
    tokens = rows * t.seq_len // mesh.shape["sequence"]
    factor = cfg.backends.capacity_factor
    slots = m.moe.num_experts * capacity(m.moe.experts_per_token, tokens, factor, m.moe.num_experts)
    assert [(c.axes, c.group_size) for c in a2a] == [(("expert",), n)]
    assert a2a[0].count == per_layer * moe_layers * accum
    assert a2a[0].bytes == pytest.approx(a2a[0].count * slots * m.d_model * 4 * (n - 1) / n)
    # The describe section predicts exactly this.
    section = moe_section(engine)
    assert section["all_to_all"]["count"] == a2a[0].count
    assert section["all_to_all"]["bytes_per_device"] == pytest.approx(a2a[0].bytes)
    assert section["capacity_slots"] * m.moe.num_experts == slots
    assert section["group_tokens"] == tokens
    if mesh.shape["sequence"] > 1:
        # Over sequence only attention's collectives (and the token shift's one-row halo, a
        # collective-permute): no token is gathered for routing, dispatch or the router's statistics.
        ops, context = ("all-gather", "reduce-scatter", "all-to-all"), context_section(engine)
        zero = {"count": 0, "bytes_per_device": 0.0}
        assert compiled_over_sequence(collectives, ops) == {op: context["collectives"].get(op, zero) for op in ops}


@pytest.mark.slow
@pytest.mark.tpu_aot
def test_bf16_all_to_alls_move_bf16_on_tpu():
    # XLA:CPU widens bf16 all-to-alls to f32; the TPU program moves the compute dtype, as the section says.
    engine = Engine.build(load_config(CONFIG, ["model.compute_dtype=bfloat16"]), tpu_topology_devices("v5e:2x4"))
    # The expert dispatch's; one over fsdp moves the vocabulary tables' gradients into their shards.
    (a2a,) = [c for c in _compiled_collectives(engine) if c.op == "all-to-all" and c.axes == ("expert",)]
    section = moe_section(engine)
    assert a2a.count == 8 and section["slot_buffer_bytes"] == 8 * 80 * 64 * 2
    assert a2a.bytes == pytest.approx(section["all_to_all"]["bytes_per_device"])


def test_moe_section_describes_the_layout(devices):
    engine = Engine.build(load_config(CONFIG), devices)
    s = moe_section(engine)
    assert {k: s[k] for k in ("moe_layers", "layers", "num_experts", "experts_per_token", "expert_axis",
                              "experts_per_device", "groups", "group_rows", "group_tokens", "capacity_slots")} == {
        "moe_layers": 2, "layers": [1, 3], "num_experts": 8, "experts_per_token": 2, "expert_axis": 4,
        "experts_per_device": 2, "groups": 8, "group_rows": 4, "group_tokens": 256,
        "capacity_slots": math.ceil(2 * 256 * 1.25 / 8)}
    assert s["expert_params"] == [
        {"path": "blocks.moe.mlp.w_down", "spec": [None, "expert", None, "fsdp"]},
        {"path": "blocks.moe.mlp.w_gate", "spec": [None, "expert", "fsdp"]},
        {"path": "blocks.moe.mlp.w_up", "spec": [None, "expert", "fsdp"]},
    ]
    assert s["all_to_all"]["bytes_per_device"] == 2 * 4 * 8 * 80 * 64 * 4 * 3 / 4
    assert "E=8" in s["all_to_all"]["formula"] and "C=80" in s["all_to_all"]["formula"]
    json.dumps(s)  # plain JSON for `describe --json`

    tp = moe_section(Engine.build(load_config(CONFIG, MESHES["expert2_fsdp2_tensor2"]), devices))
    assert tp["experts_per_device"] == 4
    assert {p["path"]: p["spec"] for p in tp["expert_params"]}["blocks.moe.mlp.w_gate"] == \
        [None, "expert", "fsdp", "tensor"]
    mixtral = load_config(None, ["model.preset=mixtral-8x7b", "mesh.expert=8", "mesh.fsdp=1",
                                 "train.global_batch_size=8", "train.seq_len=4096"])
    flat = moe_section(Engine.build(mixtral, devices))
    assert flat["moe_layers"] == 32 and flat["experts_per_device"] == 1 and flat["group_tokens"] == 4096
    assert flat["slot_buffer_bytes"] == 8 * 1280 * 4096 * 2  # bf16 compute: C = ceil(2 x 4096 x 1.25 / 8)
    assert moe_section(Engine.build(load_config(ROOT / "configs" / "tiny.yaml"), devices)) is None


def test_moe_section_without_exchange_and_dropless(devices):
    single = moe_section(Engine.build(load_config(CONFIG, ONE_DEVICE), devices[:1]))
    assert single["experts_per_device"] == 8 and single["expert_params"] == []
    assert single["all_to_all"]["count"] == 0 and single["group_tokens"] == 32 * 64
    cfg = load_config(CONFIG, ["backends.moe=dropless"])
    engine = Engine.build(cfg, tpu_topology_devices("v5e:2x4")) if has_libtpu() else None
    if engine is not None:
        s = moe_section(engine)
        assert s["capacity_slots"] is None and not s["all_to_all"]["exact"]
        assert s["all_to_all"]["bytes_per_device"] == pytest.approx(2 * 4 * 2 * 256 * 64 * 4 * 3 / 4)


# --- (d) training: the aux loss keeps the experts balanced --------------------------------------------

# A 32-token Markov chain: the router sees few distinct inputs, so without the load-balancing
# loss it collapses onto few experts within ~100 steps (measured at 120 steps of 16 x 32 tokens: the
# second MoE layer at the max/mean bound E/k = 4, 39% dropped; with it: 1.35, 0.9% dropped; at 200 steps
# of 32 x 64: 4.0 / 21% against 1.30 / 0.4%). On one device: balancing is the router's property, not the
# mesh's (the sharded step equals one device, above), and steps on 8 simulated devices cost collectives.
STEPS = 120
TRAINING = ["data.vocab_size=32", f"train.steps={STEPS}", "train.global_batch_size=16", "train.seq_len=32",
            "backends.capacity_factor=1.25", "mesh.fsdp=1", "mesh.expert=1"]
TAIL = 20  # steps averaged at the end


def _balance(history):
    tail = history[-TAIL:]
    load = float(np.mean([max(h["expert_load.0"], h["expert_load.1"]) for h in tail]))
    return load, float(np.mean([h["dropped_fraction"] for h in tail])), float(np.mean([h["loss"] for h in tail]))


@pytest.mark.slow
def test_training_with_the_aux_loss_lowers_the_loss_and_balances_the_experts(devices):
    history, _, _ = _train(TRAINING, devices[:1], STEPS, optimized=True)
    load, dropped, loss = _balance(history)
    print(f"aux on: max/mean expert load {load:.3f}, dropped {dropped:.2%}, "
          f"loss {history[0]['loss']:.3f} -> {loss:.3f}")
    assert loss < history[0]["loss"] - 2.0
    assert load <= 1.5
    assert dropped <= 0.05


@pytest.mark.slow
def test_training_without_the_aux_loss_is_visibly_less_balanced(devices):
    history, _, _ = _train([*TRAINING, "model.moe.router_aux_weight=0"], devices[:1], STEPS, optimized=True)
    load, dropped, _ = _balance(history)
    print(f"aux off: max/mean expert load {load:.3f}, dropped {dropped:.2%}")
    assert load >= 2.5  # vs <= 1.5 with the aux loss (measured 4.0 vs 1.35)
    assert dropped >= 0.15


# --- (e) bad input on the command line ---------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "needles"), [
    (["model.moe.num_experts=6"], ["model.moe.num_experts=6", "mesh.expert=4", "1, 2, 3, 6"]),
    (["model.moe.experts_per_token=9"], ["model.moe.experts_per_token=9", "model.moe.num_experts=8", "1 to 8"]),
    (["backends.capacity_factor=0.0"], ["backends.capacity_factor=0.0", "greater than 0"]),
    (["backends.capacity_factor=-1.5"], ["backends.capacity_factor=-1.5", "greater than 0"]),
    (["backends.moe=dropless"], ["backends.moe=dropless", "XLA:CPU", "backends.moe=capacity"]),
], ids=["experts-vs-mesh", "top-k-above-experts", "capacity-zero", "capacity-negative", "dropless-on-cpu"])
def test_bad_moe_input_exits_2_with_a_message(tmp_path, overrides, needles):
    proc = cli("train", "configs/moe.yaml", f"run.dir={tmp_path / 'run'}", *overrides)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "spmd-train: error:" in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("preset", sorted(p.stem for p in (ROOT / "meshes").glob("*.yaml")))
def test_every_mesh_preset_maps_the_moe_axes(preset):
    # Without these rules experts would be replicated (and the all-to-all would move nothing).
    rules = resolve_rules(load_config(None, [f"mesh.preset={preset}"]))
    for table in (rules.params, rules.activations):
        assert {n: table[n] for n in ("experts", "expert_mlp")} == {"experts": ("expert",), "expert_mlp": ("tensor",)}
        assert "router_experts" not in table and "sublayers" not in table


def test_shipped_moe_presets_load():
    mixtral = Engine.build(load_config(None, ["model.preset=mixtral-8x7b", "mesh.fsdp=1"]), jax.devices()[:1])
    assert mixtral.num_params == 46_702_792_704  # Mixtral 8x7B
    cfg = load_config(CONFIG)
    assert (cfg.mesh.expert, cfg.mesh.fsdp, cfg.run.simulate_devices, cfg.data.source) == (4, 2, 8, "markov")


def test_describe_reports_the_moe_section_matching_its_collectives(devices):
    from spmd_train.analysis import describe

    report = describe(load_config(CONFIG, ["run.simulate_devices=null"]), devices=list(devices)).to_json()
    moe = report["moe"]
    (a2a,) = [c for c in report["collectives"] if c["op"] == "all-to-all"]
    assert a2a["axes"] == ["expert"] and a2a["count"] == moe["all_to_all"]["count"] == 8
    assert abs(a2a["bytes"] - moe["all_to_all"]["bytes_per_device"]) <= 1e-6 * a2a["bytes"]
    assert moe["experts_per_device"] == 2 and {p["path"] for p in moe["expert_params"]} == {
        f"blocks.moe.mlp.{w}" for w in ("w_gate", "w_up", "w_down")}

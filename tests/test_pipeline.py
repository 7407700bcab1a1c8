"""Pipelined training equals the non-pipelined model, runs the simulator's ticks, and survives bubbles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from spmd_train import Engine, load_config
from spmd_train.analysis import collectives_of
from spmd_train.config.schedule_facts import names_where, schedule_facts
from spmd_train.errors import ConfigError
from spmd_train.parallel.pipeline import run_pipeline
from spmd_train.parallel.pipeline_plan import build_plan
from spmd_train.parallel.schedule_simulator import simulate
from spmd_train.parallel.schedules import build_schedule, placement_of
from spmd_train.train.pipelined import layer_order
from tests.runs import TINY, relative_error, run_steps
from tests.tiers import fast_cases

# Every registered schedule at its fewest chunks per stage: gpipe, 1f1b, interleaved_1f1b (2); zb_h1, zb_v (2).
FUSED = [(n, schedule_facts(n).min_virtual) for n in names_where(split_backward=False)]
SPLIT = [(n, schedule_facts(n).min_virtual) for n in names_where(split_backward=True)]  # backward split into B and W
SCHEDULES = FUSED + SPLIT
GRID = [(p, m) for p in (2, 4) for m in (p, 2 * p, 4 * p)]
DEEP = ["model.num_layers=8"]


# --- the executor on its own: small pure stage functions, every schedule, p in {2, 4}, m in {p, 2p, 4p}


def _toy(p, m, v):
    layers, d, rows = 2 * p * v, 8, 4
    keys = jax.random.split(jax.random.key(0), 4)
    blocks = {"w": jax.random.normal(keys[0], (layers, d, d)) / 3,
              "s": 1 + 0.1 * jax.random.normal(keys[1], (layers, d))}
    head = jax.random.normal(keys[2], (d, 3))
    x = jax.random.normal(keys[3], (m, rows, d))
    targets = jnp.cos(jnp.arange(m * rows * 3, dtype=jnp.float32)).reshape(m, rows, 3)
    return blocks, head, x, targets


def _stage(chunk, x):
    def layer(x, w):
        # RMS-normalised without epsilon: a bubble tick fed zeros would make 0/0 = NaN.
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True))
        return jnp.tanh(x @ w["w"]) * w["s"], None

    return jax.lax.scan(layer, x, chunk)[0]


def _head(head, y, target):
    return jnp.mean((y @ head - target) ** 2)


@pytest.mark.parametrize("p,m", fast_cases(GRID, fast=["4-8"], ids=lambda c: f"{c[0]}-{c[1]}", several=True))
@pytest.mark.parametrize("name,v", SCHEDULES)
def test_executor_equals_autodiff_of_the_sequential_model(devices, name, v, p, m):
    # In float64: this proves the schedule's bookkeeping, which any slip breaks by O(1); in float32
    # the two summation orders alone differ by ~1e-5 after 8 layers on some CPUs.
    with jax.enable_x64(True):
        _executor_equals_autodiff(devices, name, v, p, m)


def _executor_equals_autodiff(devices, name, v, p, m):
    blocks, head, x, targets = jax.tree.map(lambda a: a.astype(jnp.float64), _toy(p, m, v))
    order = layer_order(blocks["w"].shape[0], p, v, placement_of(name))
    inverse = np.argsort(order)

    def sequential(blocks, head, x):
        model_order = jax.tree.map(lambda a: a[inverse], blocks)  # stored rows -> model layers
        per_mb = jax.vmap(lambda xi, ti: _head(head, _stage(model_order, xi), ti))(x, targets)
        return jnp.mean(per_mb)

    ref_loss, ref_grads = jax.value_and_grad(sequential, argnums=(0, 1, 2))(blocks, head, x)
    plan = build_plan(build_schedule(name, p, m, v))
    mesh = jax.make_mesh((p, 8 // p), ("pipeline", "data"), axis_types=(AxisType.Auto,) * 2, devices=devices)
    stored = jax.device_put(blocks, NamedSharding(mesh, P("pipeline")))
    step = jax.jit(lambda b, h, x: run_pipeline(_stage, _head, plan, b, h, x, targets, mesh=mesh))
    loss, g_blocks, g_head, g_x = step(stored, head, x)
    assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
    assert relative_error((g_blocks, g_head, g_x), ref_grads) <= 1e-5
    # Every tick sends one value each way around the ring (fused: an activation down and a cotangent up;
    # split: the op's output both ways, the plan keeping the real copy): 2 permutes per tick, as simulated.
    # Split plans at p = 2 send once: both rings are the same permutation.
    per_tick = 1 if plan.schedule.split_backward and p == 2 else 2
    text = step.lower(stored, head, x).compile().as_text()
    permutes = [c for c in collectives_of(text, mesh) if c.op == "collective-permute" and c.axes == ("pipeline",)]
    assert sum(c.count for c in permutes) == per_tick * simulate(plan.schedule).num_ticks == per_tick * plan.num_ticks


# --- the whole model: 3 optimizer steps against one device


@pytest.fixture(scope="module")
def reference(devices):
    losses, params, _, _ = run_steps(["mesh.fsdp=1", *DEEP], devices[:1])
    return losses, params


def _check(reference, overrides, devices):
    ref_losses, ref_params = reference
    losses, params, engine, _ = run_steps([*DEEP, *overrides], devices)
    assert engine.plan is not None
    assert np.abs(losses - ref_losses).max() / np.abs(ref_losses).max() <= 1e-5, (losses, ref_losses)
    assert relative_error(engine.model_params(params), ref_params) <= 1e-5
    return engine


@pytest.mark.parametrize("name,v", fast_cases(SCHEDULES, fast=["1f1b-1", "zb_v-2"], ids=lambda c: f"{c[0]}-{c[1]}",
                                              several=True))
def test_pipeline_fsdp_tensor_equals_one_device(reference, devices, name, v):
    engine = _check(reference, ["mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2",
                                f"parallel.pipeline_schedule={name}", f"parallel.virtual_stages={v}"], devices)
    assert dict(engine.mesh.shape)["pipeline"] == 2


# The executor test above proves every schedule's bookkeeping on the whole grid; the model needs one case of each
# kind per schedule: a 2-stage pipeline with 2 microbatches per stage, 4 stages with the fewest (m = p) and the most.
MODEL_GRID = [(2, 4), (4, 4), (4, 16)]


# The split schedules share the fused ones' model path except for B/W: one 4-stage case each.
HEAVY = [(name, v, p, m) for name, v in FUSED for p, m in MODEL_GRID] + [(name, v, 4, 8) for name, v in SPLIT]


@pytest.mark.slow
@pytest.mark.parametrize("name,v,p,m", HEAVY)
def test_pipelined_model_equals_one_device(reference, devices, name, v, p, m):
    _check(reference, [f"mesh.pipeline={p}", f"mesh.fsdp={8 // p}", f"parallel.pipeline_schedule={name}",
                       f"parallel.virtual_stages={v}", f"parallel.pipeline_microbatches={m}"], devices)


@pytest.mark.parametrize("extra", [
    pytest.param(["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=2", "train.grad_accum=2"], marks=pytest.mark.slow),
    pytest.param(["mesh.fsdp=4", "parallel.zero_stage=2", "parallel.remat=full"], marks=pytest.mark.slow),
    pytest.param(["mesh.fsdp=4", "parallel.zero_stage=1"], marks=pytest.mark.slow),
], ids=["data_tensor_accum", "zero2_remat", "zero1"])
def test_pipeline_with_other_parallelism(reference, devices, extra):
    _check(reference, ["mesh.pipeline=2", *extra], devices)


def test_bubbles_never_reach_gradients(devices):
    # norm_eps=0: RMSNorm of an all-zero bubble input is 0 * inf = NaN; none may appear.
    overrides = ["model.norm_eps=0.0", *DEEP]
    ref_losses, ref_params, _, _ = run_steps(["mesh.fsdp=1", *overrides], devices[:1])
    losses, params, engine, _ = run_steps(["mesh.pipeline=4", "mesh.fsdp=2", "parallel.pipeline_schedule=gpipe",
                                           *overrides], devices)
    assert np.isfinite(losses).all() and all(np.isfinite(a).all() for a in jax.tree.leaves(params))
    assert np.abs(losses - ref_losses).max() / np.abs(ref_losses).max() <= 1e-5
    assert relative_error(engine.model_params(params), ref_params) <= 1e-5


def test_interleaved_storage_order_is_a_permutation_recorded_by_the_engine(devices):
    cfg = load_config(None, [*TINY, *DEEP, "mesh.pipeline=2", "mesh.fsdp=4",
                             "parallel.pipeline_schedule=interleaved_1f1b", "parallel.virtual_stages=2"])
    engine = Engine.build(cfg, devices)
    # 8 layers, 2 stages x 2 chunks of 2: device 0 stores model chunks 0 and 2, device 1 chunks 1 and 3.
    assert engine.layer_order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    plain = Engine.build(load_config(None, [*TINY, *DEEP, "mesh.fsdp=8"]), devices)
    stored = engine.init_state().params
    assert relative_error(engine.model_params(jax.tree.map(np.asarray, stored)),
                          jax.tree.map(np.asarray, plain.init_state().params)) == 0.0


def test_v_storage_order_puts_both_legs_of_the_v_on_each_device():
    # 8 layers, 2 stages x 2 chunks of 2: device 0 stores model chunks 0 and 3, device 1 chunks 1 and 2.
    assert layer_order(8, 2, 2, placement_of("zb_v")).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert layer_order(8, 4, 2, "v").tolist() == [0, 7, 1, 6, 2, 5, 3, 4]  # one layer per chunk


@pytest.mark.parametrize("overrides,needle", [
    (["mesh.pipeline=4", "mesh.fsdp=2", "model.num_layers=6", "parallel.pipeline_layers=null"],
     "model.num_layers=6 is not divisible by mesh.pipeline=4"),
    # "balanced" is equal chunks under a split-backward schedule.
    (["mesh.pipeline=2", "mesh.fsdp=4", "parallel.pipeline_schedule=zb_v", "parallel.virtual_stages=2",
      "model.num_layers=6", "parallel.pipeline_layers=balanced"],
     "model.num_layers=6 is not divisible by mesh.pipeline=2 x parallel.virtual_stages=2 "
     r"= 4: .*parallel.pipeline_schedule=zb_v runs equal stage chunks only"),
    (["mesh.pipeline=4", "mesh.fsdp=2", *DEEP, "parallel.pipeline_microbatches=2"], "parallel.pipeline_microbatches=2"),
    (["mesh.pipeline=4", "mesh.fsdp=2", *DEEP, "parallel.pipeline_schedule=interleaved_1f1b",
      "parallel.virtual_stages=2", "parallel.pipeline_microbatches=2"], "parallel.pipeline_microbatches=2"),
    (["mesh.pipeline=2", "mesh.fsdp=4", "parallel.virtual_stages=2"], "parallel.virtual_stages=2"),
    (["mesh.pipeline=2", "mesh.fsdp=4", "parallel.pipeline_microbatches=3"],
     "parallel.pipeline_microbatches=3 does not divide"),
    (["mesh.pipeline=2", "mesh.fsdp=4", "parallel.pipeline_schedule=zb_v"],
     "parallel.virtual_stages=1 is invalid with parallel.pipeline_schedule=zb_v"),
    (["mesh.pipeline=2", "mesh.fsdp=4", "parallel.pipeline_schedule=zb_v", "parallel.virtual_stages=3",
      "model.num_layers=6"], "parallel.virtual_stages=3 is invalid with parallel.pipeline_schedule=zb_v"),
    (["mesh.pipeline=2", "mesh.fsdp=4", "parallel.pipeline_schedule=zb_h1", "parallel.virtual_stages=2"],
     "parallel.virtual_stages=2 is invalid for parallel.pipeline_schedule=zb_h1"),
])
def test_bad_pipeline_configs_name_the_numbers(devices, overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        Engine.build(load_config(None, [*TINY, *overrides]), devices)


def test_interleaved_needs_microbatches_in_groups_of_stages(devices):
    cfg = load_config(None, [*TINY, *DEEP, "mesh.pipeline=4", "mesh.fsdp=2",
                             "parallel.pipeline_schedule=interleaved_1f1b", "parallel.virtual_stages=2",
                             "parallel.pipeline_microbatches=2", "train.global_batch_size=16"])
    with pytest.raises(ConfigError, match=r"parallel.pipeline_microbatches=2 is (not divisible by|invalid)"):
        Engine.build(cfg, devices)


@pytest.mark.slow
def test_bf16_compute_pipeline_trains_like_one_device(devices):
    # bf16 activations cross stages and the input gradients are summed over `pipeline`.
    common = [*DEEP, "model.compute_dtype=bfloat16"]
    ref_losses, _, _, _ = run_steps(["mesh.fsdp=1", *common], devices[:1])
    losses, _, _, _ = run_steps(["mesh.pipeline=2", "mesh.fsdp=4", *common], devices)
    assert np.abs(losses - ref_losses).max() <= 2e-2 * np.abs(ref_losses).max()


@pytest.mark.parametrize("virtual", [1, 3])
def test_zb_v_needs_two_virtual_stages_and_says_so(capsys, virtual):
    from spmd_train.cli.main import main

    code = main(["describe", "configs/pipeline.yaml", "parallel.pipeline_schedule=zb_v",
                 f"parallel.virtual_stages={virtual}"])
    err = capsys.readouterr().err
    assert code == 2 and f"parallel.virtual_stages={virtual} is invalid" in err, err
    assert "set parallel.virtual_stages=2" in err

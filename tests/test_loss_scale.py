"""precision.loss_scale=dynamic: float16 compute with a loss scale that overflows down and grows back, exact in
float32, sharded like one device, kept in checkpoints, refused where it does not apply, and float16's training parity
with bfloat16."""

import jax.numpy as jnp
import numpy as np
import pytest

from spmd_train import load_config
from spmd_train.data import make_source
from spmd_train.errors import ConfigError
from spmd_train.train.guards import OVERFLOW, REASONS, init_guard, judge
from spmd_train.train.loss_scale import LossScaleState, adjust, unscale
from tests.runs import ROOT, relative_error, run_steps
from tests.test_moe_model import NO_DROPS, ONE_DEVICE
from tests.test_moe_model import _train as moe_train
from tests.test_pipeline_moe import PIPELINED
from tests.tiers import fast_cases

SCALED = ["precision.loss_scale=dynamic"]
FP16 = ["model.compute_dtype=float16", *SCALED]


def test_an_overflow_halves_the_scale_and_a_run_of_good_steps_doubles_it():
    state = LossScaleState(jnp.float32(2.0**16), jnp.int32(0), None)
    yes, no = jnp.bool_(True), jnp.bool_(False)
    state = adjust(state, overflow=yes, applied=no, growth_interval=3)
    assert (float(state.scale), int(state.good_steps)) == (2.0**15, 0)
    for _ in range(2):
        state = adjust(state, overflow=no, applied=yes, growth_interval=3)
    assert (float(state.scale), int(state.good_steps)) == (2.0**15, 2)
    state = adjust(state, overflow=no, applied=no, growth_interval=3)  # a spike: neither counts nor resets
    assert (float(state.scale), int(state.good_steps)) == (2.0**15, 2)
    state = adjust(state, overflow=no, applied=yes, growth_interval=3)
    assert (float(state.scale), int(state.good_steps)) == (2.0**16, 0)
    floor = adjust(LossScaleState(jnp.float32(1.0), jnp.int32(5), None), overflow=yes, applied=no, growth_interval=3)
    assert float(floor.scale) == 1.0  # never below 1


def test_an_overflow_is_told_apart_from_a_diverged_model_and_float16_gradients_unscale_in_float32():
    cfg = load_config(None, []).train
    guard, inf, big = init_guard(cfg), jnp.float32(jnp.inf), jnp.float32(2.0**10)
    code = lambda loss, norm, scale: REASONS[int(judge(guard, jnp.float32(loss), jnp.float32(norm), cfg,
                                                       loss_scale=scale))]
    assert code(2.0, inf, big) == "overflow"
    assert code(jnp.nan, inf, big) == "nonfinite"  # the loss itself: the model's
    assert code(2.0, inf, jnp.float32(1.0)) == "nonfinite"  # at the scale's floor an overflow is the model's too
    assert code(2.0, inf, None) == "nonfinite"  # no loss scale: as before
    assert OVERFLOW == REASONS.index("overflow")
    # 2^-20 in float16 is subnormal; scaled by 2^16 it is representable, and unscaled in float32 it is exact.
    g = jnp.asarray([2.0**-20 * 2.0**16, 65504.0], jnp.float16)
    out = unscale({"w": g, "b": jnp.asarray([3.0], jnp.bfloat16)}, jnp.float32(2.0**16))
    assert out["w"].dtype == jnp.float32 and out["b"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out["w"]), [2.0**-20, 65504.0 / 2.0**16])


def test_a_scale_too_large_skips_steps_until_it_fits_and_the_run_goes_on(devices):
    # 2^32 overflows float16's cotangents (largest 65504); each skip halves it, and this model's fit from 2^20 on
    # (measured: 12 skips). The step guards' limit of consecutive skips (train.max_consecutive_skips=10 by default)
    # does not count these, so the run goes on past 10.
    losses, *_, state = run_steps([*FP16, "precision.loss_scale_init=4294967296", "mesh.fsdp=1"], devices[:1],
                                  steps=16)
    skipped = int(state.guard.skipped)
    assert 10 < skipped < 16, skipped  # all 16 would mean the scale never came down to fit
    assert float(state.opt_state.scale) == 2.0 ** (32 - skipped)
    assert int(state.guard.consecutive) == 0 and int(state.opt_state.good_steps) == 16 - skipped
    assert np.isfinite(losses).all() and losses[-1] < losses[0]  # the applied steps learn


def test_a_scaled_float32_run_over_data_fsdp_and_tensor_equals_an_unscaled_one_device_run(devices):
    # Powers of two scale float32 exactly: the scale enters every cotangent (through the gradient region's shard_map
    # over `data`) and leaves in the unscale, and the steps equal those without it up to summation order.
    growth = ["precision.loss_scale_growth_interval=1"]  # 2^16, 2^17, 2^18: each step under another scale
    ref, ref_params, *_ = run_steps(["mesh.fsdp=1"], devices[:1])
    got, params, _, state = run_steps([*SCALED, *growth, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], devices)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    assert relative_error(params, ref_params) < 1e-5
    assert float(state.opt_state.scale) == 2.0**19 and int(state.guard.skipped) == 0


@pytest.mark.parametrize("schedule", fast_cases(["1f1b", "zb_h1"], fast=["zb_h1"]))
def test_a_scaled_float32_moe_pipeline_equals_an_unscaled_one_device_run(devices, schedule):
    # Each microbatch's backward starts from the scale (the heads' and the router terms' cotangents), under the fused
    # executor (1F1B) and the split one (zero-bubble: B and W apart); router metrics and losses come back unscaled.
    base = [NO_DROPS, "model.num_layers=8", "train.seq_len=16", "train.global_batch_size=16"]
    ref, ref_params, _ = moe_train([*base, *ONE_DEVICE, "train.grad_accum=4"], devices[:1], 3)
    got, params, engine = moe_train([*base, *SCALED, "precision.loss_scale_growth_interval=1", *PIPELINED,
                                     f"parallel.pipeline_schedule={schedule}"], devices, 3)
    for key in ("loss", "grad_norm", "aux_loss", "z_loss"):
        np.testing.assert_allclose([h[key] for h in got], [h[key] for h in ref], rtol=1e-5, err_msg=key)
    assert [h["loss_scale"] for h in got] == [2.0**17, 2.0**18, 2.0**19]
    assert relative_error(engine.model_params(params), ref_params) < 1e-5


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.compute_dtype=float16"], r"model.compute_dtype \(precision.compute\)=float16 needs precision.loss_scale"),
    (["model.param_dtype=float16", *FP16], r"model.param_dtype \(precision.params\)=float16 needs precision.master"),
    ([*FP16, "backends.attention=pallas"], "our flash-attention kernels take float32 or bfloat16"),
])
def test_float16_settings_that_cannot_train_are_refused_naming_the_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


BF16_300 = 1.1097
"""bfloat16 compute's final loss over the floor on configs/tiny.yaml (AdamW, lr 3e-3) in 300 steps, the mean of the last
20 (tests/test_optimizer.py's way, on one device of this machine; float32 compute: 1.1097 too): what float16 with a
dynamic loss scale must come within 1% of."""


@pytest.mark.slow
def test_float16_with_a_dynamic_loss_scale_trains_within_one_percent_of_bfloat16(devices):
    floor = make_source(load_config(ROOT / "configs/tiny.yaml")).loss_floor
    losses, *_, state = run_steps([*FP16, "mesh.fsdp=1", "mesh.tensor=1", "train.steps=300"], devices[:1],
                                  steps=300, config="configs/tiny.yaml", optimized=True)
    assert abs(losses[-20:].mean() / floor - BF16_300) <= 0.01 * BF16_300, losses[-20:].mean() / floor
    assert float(state.opt_state.scale) >= 2.0**16 and int(state.guard.skipped) == 0  # measured: 1.1097, no overflow

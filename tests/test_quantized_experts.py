"""precision.matmul for the routed experts: their batched matmuls in FP8 (per-tensor or row scales) or int8, the
ragged ones in per-tensor FP8, how far from exact, int8 dots in the program, sharded against one device, and the
planner's compute share."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmd_train import load_config
from spmd_train.ops.experts import ExpertWeights, batched_swiglu, ragged_swiglu
from spmd_train.ops.matmul_mode import use_matmul
from tests.runs import ROOT, relative_error
from tests.test_fp8 import _gradients, _rel, quantization_and_mesh_errors


def _weights(rng, experts=4, d=32, f=48):
    return ExpertWeights(*(jnp.asarray(rng.normal(size=s) * 0.1, jnp.float32)
                           for s in ((experts, d, f), (experts, d, f), (experts, f, d))))


def _run(fn, mode, *args):
    """fn's output and its gradients in (x, weights) under `mode`'s matmuls."""
    with use_matmul(mode):
        out = fn(*args)
        grads = jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), (0, 1))(*args)
    return out, grads


def test_the_batched_experts_run_each_mode_within_its_rounding_and_int8_as_s8_dots():
    rng = np.random.default_rng(0)
    x, w = jnp.asarray(rng.normal(size=(2, 4, 8, 32)), jnp.float32), _weights(rng)  # [G, E, C, d]
    batched = lambda x, w: batched_swiglu(x, w, jnp.float32)
    exact = _run(batched, "default", x, w)
    # Measured: int8 and row-scaled FP8 about 1% and 4% from exact, per-tensor FP8 about 4-5%, outputs and
    # gradients alike (three matmuls each, the activation between).
    for mode, bound in (("int8", 0.03), ("fp8-row", 0.08), ("fp8", 0.1)):
        out, grads = _run(batched, mode, x, w)
        assert 0.001 < _rel(out, exact[0]) < bound, (mode, _rel(out, exact[0]))
        assert relative_error(grads, exact[1]) < 2 * bound, (mode, relative_error(grads, exact[1]))
    with use_matmul("int8"):
        text = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(batched(x, w))), (0, 1))).lower(x, w).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    # Forward and backward: 3 expert matmuls x (1 + 2), each an i8 x i8 -> i32 dot_general; every other dot is a
    # scales' outer product (nothing contracted).
    int8 = [d for d in dots if re.search(r"\(tensor<[\dx]+xi8>, tensor<[\dx]+xi8>\) -> tensor<[\dx]+xi32>", d)]
    assert len(int8) == 9 and all("contracting_dims = [] x []" in d for d in dots if d not in int8), dots


def test_the_ragged_experts_run_per_tensor_fp8_and_keep_the_compute_dtype_otherwise():
    rng = np.random.default_rng(1)
    x, w = jnp.asarray(rng.normal(size=(24, 32)), jnp.float32), _weights(rng)
    sizes = jnp.asarray([6, 10, 0, 5], jnp.int32)  # 21 rows in groups; 3 padding rows
    ragged = lambda x, w: ragged_swiglu(x, sizes, w, jnp.float32)
    exact = _run(ragged, "default", x, w)
    fp8 = _run(ragged, "fp8", x, w)
    assert 0.01 < _rel(fp8[0], exact[0]) < 0.1 and relative_error(fp8[1], exact[1]) < 0.2
    for mode in ("int8", "fp8-row"):  # `config.precision_schema.quantizes_experts` says so to the planner
        same = _run(ragged, mode, x, w)
        np.testing.assert_array_equal(same[0], exact[0])


def test_int8_experts_over_expert_and_fsdp_stay_close_to_one_devices(devices):
    # Capacity 4 = E / k: nothing dropped, so the groups' different shapes route alike. Inside the expert region each
    # device scales a weight gradient over its own tokens (the ops know no mesh): the experts' gradients 1e-2 from
    # one device's (the rest 3e-7), against int8's own 0.12.
    moe = ["model.preset=moe-tiny", "model.num_layers=2", "mesh.tensor=1", "backends.capacity_factor=4"]
    int8_error, mesh_error = quantization_and_mesh_errors("int8", devices, moe, ("mesh.expert=4", "mesh.fsdp=2"))
    assert 0.002 < int8_error < 0.3 and mesh_error < 0.25 * int8_error, (int8_error, mesh_error)


def test_the_planner_counts_the_experts_share_where_their_matmuls_are_quantized():
    from spmd_train.analysis.plan.candidate import Workload
    from spmd_train.analysis.plan.shape import ModelShape
    from spmd_train.analysis.plan.timing import quantized_share

    cfg = load_config(ROOT / "configs" / "moe.yaml", ["model.preset=mixtral-8x7b"])
    shape = ModelShape.from_config(cfg.model)
    share = lambda matmul, impl: quantized_share(shape, Workload(global_batch=8, seq_len=4096, matmul=matmul,
                                                                 moe_impl=impl))
    experts = 6 * 3 * shape.d_model * shape.moe_d_ff * shape.experts_per_token * shape.moe_layers
    per_token = shape.flops_per_token(4096)
    # Mixtral: the routed experts are most of a token's FLOPs (2 of 8 experts, 32 layers).
    assert experts / per_token > 0.7
    assert share("int8", "capacity") == pytest.approx(share("int8", "dropless") + experts / per_token, rel=1e-9)
    assert share("fp8", "dropless") == share("fp8", "capacity") == share("int8", "capacity")


def test_row_scaled_experts_run_where_the_expert_region_splits_their_hidden_width_over_tensor(devices):
    # Inside the region the activation is the same on both tensor devices and the weights are split there: the
    # custom gradient's input cotangent varies over tensor and is summed back (`ops.rowwise.same_vma`); before that
    # cast the step did not trace. Measured against the same layout's default matmuls: int8 0.12, FP8 rows 0.21
    # (largest leaf: the router's gradient).
    moe = ["model.preset=moe-tiny", "model.num_layers=2", "mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2",
           "backends.capacity_factor=4"]
    exact = _gradients(moe, devices, "default")
    for mode in ("int8", "fp8-row"):
        assert 0.01 < relative_error(_gradients(moe, devices, mode), exact) < 0.3, mode

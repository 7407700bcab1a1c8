"""Sharded training equals single-device training: per-step loss and final parameters."""

import pytest

from tests.golden_layouts import MESH_PRESETS
from tests.runs import relative_error, run_steps
from tests.tiers import fast_cases

LAYOUTS = {
    "data8": ["mesh.data=8", "mesh.fsdp=1"],
    "fsdp8_zero1": ["mesh.fsdp=8", "parallel.zero_stage=1"],
    "fsdp8_zero2": ["mesh.fsdp=8", "parallel.zero_stage=2"],
    "fsdp8_zero3": ["mesh.fsdp=8", "parallel.zero_stage=3"],
    "data2_tensor4": ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=4"],
    "fsdp2_tensor4": ["mesh.fsdp=2", "mesh.tensor=4", "parallel.sequence_parallel=false"],
    "fsdp2_tensor4_sp": ["mesh.fsdp=2", "mesh.tensor=4", "parallel.sequence_parallel=true"],
    "data2_fsdp2_tensor2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
}


@pytest.fixture(scope="module")
def reference(devices):
    """One device, no accumulation: the ground truth every layout must reproduce."""
    losses, params, _, _ = run_steps(["mesh.fsdp=1"], devices[:1])
    _, init_params, _, _ = run_steps(["mesh.fsdp=1"], devices[:1], steps=0)
    # The parameters moved: equality below is not the trivial equality of untrained weights.
    assert relative_error(params, init_params) > 1e-3
    return losses, params


@pytest.mark.parametrize(("layout", "grad_accum"), fast_cases(
    [(layout, accum) for accum in (1, 4) for layout in LAYOUTS],
    fast=["data8-1", "fsdp8_zero3-4", "fsdp2_tensor4_sp-1"],
    ids=lambda case: f"{case[0]}-{case[1]}", several=True))
def test_sharded_run_equals_single_device(reference, devices, layout, grad_accum):
    ref_losses, ref_params = reference
    losses, params, _, _ = run_steps([*LAYOUTS[layout], f"train.grad_accum={grad_accum}"], devices)
    assert abs(losses - ref_losses).max() / abs(ref_losses).max() <= 1e-5, (losses, ref_losses)
    assert relative_error(params, ref_params) <= 1e-5


@pytest.mark.slow
def test_single_device_grad_accum_equals_full_batch(reference, devices):
    ref_losses, ref_params = reference
    losses, params, _, _ = run_steps(["mesh.fsdp=1", "train.grad_accum=4"], devices[:1])
    assert abs(losses - ref_losses).max() / abs(ref_losses).max() <= 1e-5
    assert relative_error(params, ref_params) <= 1e-5


SINGLE_DEVICE = [f"mesh.{axis}=1" for axis in ("data", "fsdp", "tensor", "sequence", "expert", "pipeline")] + [
    "mesh.dcn.data=1"
]


SHIPPED = fast_cases([("tiny", ()), ("pipeline", ()), *(("mesh_presets", (f"mesh.preset={p}",)) for p in MESH_PRESETS)],
                     fast=["tiny"], ids=lambda case: "-".join([case[0], *(o.split("=")[1] for o in case[1])]),
                     several=True)


@pytest.mark.parametrize(("name", "preset"), SHIPPED)
def test_shipped_configs_match_one_device(devices, name, preset):
    path = f"configs/{name}.yaml"
    common = [*preset, "train.steps=2", "train.seq_len=16"]
    losses, params, engine, _ = run_steps(common, devices, steps=2, config=path)
    assert engine.mesh.size == 8
    ref_losses, ref_params, _, _ = run_steps([*common, *SINGLE_DEVICE], devices[:1], steps=2, config=path)
    assert abs(losses - ref_losses).max() / abs(ref_losses).max() <= 1e-5
    assert relative_error(params, ref_params) <= 1e-5

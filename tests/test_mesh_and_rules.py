"""Mesh construction and logical -> physical sharding rules."""

import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from spmd_train import Layout, build_mesh, load_config
from spmd_train.config.mesh_schema import MESH_AXES
from spmd_train.errors import ConfigError
from spmd_train.mesh import resolve_axis_sizes


def test_fill_axis_and_order(devices):
    mesh = build_mesh(load_config(None, ["mesh.data=2", "mesh.fsdp=-1", "mesh.tensor=2"]).mesh, devices)
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == {"data": 2, "pipeline": 1, "fsdp": 2, "sequence": 1, "expert": 1, "tensor": 2}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    # tensor is innermost: each tensor group is a pair of neighbouring devices.
    ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(-1, 2)
    assert all(b - a == 1 for a, b in ids)


def test_slow_link_factors_on_one_host_keep_the_layout(devices):
    cfg = load_config(None, ["mesh.preset=hsdp"])
    mesh = build_mesh(cfg.mesh, devices)
    assert (mesh.shape["data"], mesh.shape["fsdp"]) == (2, 4)


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["mesh.fsdp=3", "mesh.tensor=2"], ["fsdp=3", "tensor=2", "multiply to 6", "8 devices"]),
        (["mesh.fsdp=-1", "mesh.tensor=3"], ["mesh.fsdp=-1", "tensor=3", "does not divide the 8 devices"]),
    ],
)
def test_mesh_size_errors(overrides, needles):
    with pytest.raises(ConfigError) as err:
        resolve_axis_sizes(load_config(None, overrides).mesh, 8)
    for needle in needles:
        assert needle in str(err.value)


def _layout(devices, *overrides):
    cfg = load_config(None, list(overrides))
    return Layout.from_config(cfg, build_mesh(cfg.mesh, devices))


def test_zero_stage_chooses_which_trees_are_split_over_fsdp(devices):
    wq = P("layers", "embed", "heads", "head_dim")
    shape = (2, 64, 8, 8)
    expect = {0: (False, False, False), 1: (False, False, True), 2: (False, True, True), 3: (True, True, True)}
    for stage, (params, grads, opt) in expect.items():
        layout = _layout(devices, "mesh.fsdp=4", "mesh.tensor=2", f"parallel.zero_stage={stage}")
        tree = {"wq": wq}
        shapes = {"wq": np.zeros(shape)}
        got = [
            layout.param_shardings(tree, shapes)["wq"].spec,
            layout.grad_shardings(tree, shapes)["wq"].spec,
            layout.opt_shardings(tree, shapes)["wq"].spec,
        ]
        for spec, split in zip(got, (params, grads, opt), strict=False):
            assert spec == (P(None, "fsdp", "tensor") if split else P(None, None, "tensor")), (stage, got)


def test_activation_rules_and_sequence_parallel(devices):
    plain = _layout(devices, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    assert plain.activation_spec(P("batch", "norm_length", "embed")) == P(("data", "fsdp"))
    assert plain.activation_spec(P("batch", "length", "heads", "head_dim")) == P(("data", "fsdp"), None, "tensor")
    sp = _layout(devices, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.sequence_parallel=true")
    assert sp.activation_spec(P("batch", "norm_length", "embed")) == P(("data", "fsdp"), "tensor")
    assert sp.activation_spec(P("batch", "length", "embed")) == P(("data", "fsdp"))


def test_a_mesh_axis_mapped_to_two_dimensions_of_one_array_is_a_clear_error(devices):
    layout = _layout(devices, "mesh.tensor=8", "mesh.fsdp=1", "mesh.rules.params.embed=[tensor]")
    with pytest.raises(ConfigError) as err:
        layout.param_spec(P("embed", "mlp"), (64, 128), fsdp=True, what="['w_gate']")
    for needle in ("['w_gate']", "'tensor'", "'embed'", "'mlp'", "--rules"):
        assert needle in str(err.value)


def test_indivisible_dimension_is_a_clear_error(devices):
    layout = _layout(devices, "mesh.fsdp=8")
    with pytest.raises(ConfigError) as err:
        layout.param_spec(P("vocab", "embed"), (256, 60), fsdp=True, what="['embedding']")
    for needle in ("['embedding']", "'embed'", "size 60", "fsdp=8", "multiple of 8"):
        assert needle in str(err.value)

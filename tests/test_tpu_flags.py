"""The libtpu flags spmd_train sets: merged into LIBTPU_INIT_ARGS without overriding the user's, and what they change.

Without them libtpu compiles a 64-way weight gather on v5p:4x4x4 to an all-reduce of a padded buffer and a
64-way gradient reduce-scatter to an all-reduce + slice (2x the bytes each; docs/describe.md, "ZeRO-3 on large slices").
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmd_train.analysis.hlo import parse_collectives
from spmd_train.analysis.topology import tpu_topology_devices
from spmd_train.tpu_flags import TPU_FLAGS, apply_tpu_flags, merged_init_args, parse_init_args, tpu_flags_in_effect


def test_flags_are_appended_and_a_users_own_value_wins():
    merged = merged_init_args("--xla_enable_async_all_gather=false --xla_other=3")
    flags = parse_init_args(merged)
    assert flags["xla_enable_async_all_gather"] == "false"  # the user's value is kept, not duplicated
    assert merged.count("xla_enable_async_all_gather") == 1
    assert flags["xla_other"] == "3"
    assert all(flags[name] == value for name, value in TPU_FLAGS.items() if name != "xla_enable_async_all_gather")
    assert merged_init_args(merged) == merged  # idempotent


def test_apply_sets_the_environment_and_can_be_switched_off():
    env = {"LIBTPU_INIT_ARGS": "--xla_other"}
    apply_tpu_flags(env)
    assert tpu_flags_in_effect(env) == TPU_FLAGS
    assert parse_init_args(env["LIBTPU_INIT_ARGS"])["xla_other"] == "true"
    off = {"SPMD_TRAIN_TPU_FLAGS": "0"}
    apply_tpu_flags(off)
    assert "LIBTPU_INIT_ARGS" not in off and tpu_flags_in_effect(off) == {}


@pytest.mark.tpu_aot
def test_a_64_way_gather_and_reduce_scatter_stay_what_they_are_on_a_3d_torus():
    # Importing spmd_train applied the flags before libtpu loaded in this process.
    assert tpu_flags_in_effect() == TPU_FLAGS
    devices = tpu_topology_devices("v5p:4x4x4")
    mesh = Mesh(jax.experimental.mesh_utils.create_device_mesh((64,), devices, allow_split_physical_axes=True),
                ("fsdp",))
    shard = NamedSharding(mesh, P("fsdp", None))

    def step(w, x):
        gathered = jax.lax.with_sharding_constraint(w.astype(jnp.bfloat16), NamedSharding(mesh, P()))
        y = x @ gathered  # x is split over its rows (the batch): the weight gradient is a partial sum
        return jax.lax.with_sharding_constraint(x.T @ y, shard)  # reduced into the weight's shard

    w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=shard)
    x = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16, sharding=shard)
    kinds = {c.kind for c in parse_collectives(jax.jit(step).lower(w, x).compile().as_text(), 64)}
    assert kinds == {"all-gather", "reduce-scatter"}, kinds


@pytest.mark.tpu_aot
def test_gradients_scattered_on_a_trailing_model_dimension_are_reduce_scatters_on_a_2d_torus():
    # Without xla_tpu_enable_sparse_core_collective_offload_reduce_scatter these two are all-reduces on a
    # v6e 4x4 (16-way fsdp); the gate/up projection, scattered on its leading dimension, never was.
    devices = tpu_topology_devices("v6e:4x4")
    mesh = Mesh(jax.experimental.mesh_utils.create_device_mesh((16,), devices, allow_split_physical_axes=True),
                ("fsdp",))
    rows = NamedSharding(mesh, P("fsdp"))
    # Llama-3.2-1B's shapes (smaller ones compile to reduce-scatters either way).
    for equation, a, b, spec in [("blf,bld->fd", (8192,), (2048,), P(None, "fsdp")),  # a down projection
                                 ("bld,blhk->dhk", (2048,), (32, 64), P("fsdp", None, None))]:  # a query projection

        def grad(x, y, equation=equation, spec=spec):
            return jax.lax.with_sharding_constraint(jnp.einsum(equation, x, y), NamedSharding(mesh, spec))

        x = jax.ShapeDtypeStruct((16, 256, *a), jnp.bfloat16, sharding=rows)
        y = jax.ShapeDtypeStruct((16, 256, *b), jnp.bfloat16, sharding=rows)
        kinds = {c.kind for c in parse_collectives(jax.jit(grad).lower(x, y).compile().as_text(), 16)}
        assert kinds == {"reduce-scatter"}, (equation, kinds)

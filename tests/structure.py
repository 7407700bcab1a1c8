"""Helpers for structure tests: compile pieces of the model on a mesh and read their collectives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd_train import Layout, build_mesh, load_config, use_layout
from spmd_train.analysis import collectives_of
from spmd_train.models.transformer import MLP, RESIDUAL
from tests.runs import abstract_like


def mlp_forward_collectives(devices, overrides, batch=8, length=16):
    """Collectives of one MLP block's forward pass, input and output in the residual layout."""
    cfg = load_config(None, ["model.preset=tiny", "parallel.zero_stage=0", *overrides])
    mesh = build_mesh(cfg.mesh, devices)
    layout = Layout.from_config(cfg, mesh)
    abstract = nnx.eval_shape(lambda: MLP(cfg.model, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    logical = nnx.to_pure_dict(jax.tree.map(lambda v: v.get_metadata()["logical_axes"], state,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable)))
    shapes = nnx.to_pure_dict(state)
    param_sh = layout.param_shardings(logical, shapes)
    x_sh = NamedSharding(mesh, layout.activation_spec(P(*RESIDUAL)))

    def forward(params, x):
        with use_layout(layout):
            return nnx.merge(graphdef, params)(x)

    params = abstract_like(shapes, param_sh)
    x = jax.ShapeDtypeStruct((batch, length, cfg.model.d_model), jnp.float32, sharding=x_sh)
    compiled = jax.jit(forward, out_shardings=x_sh).lower(params, x).compile()
    return collectives_of(compiled.as_text(), mesh)

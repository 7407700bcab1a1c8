"""Weight decay reaches matrices only, whatever stacking axes the layer scan adds."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from spmd_train import load_config
from spmd_train.models.layers import STACKING_AXES
from spmd_train.models.transformer import Transformer
from spmd_train.train.optimizer import make_optimizer


def _model(overrides):
    cfg = load_config(None, ["model.preset=tiny", *overrides])
    model = Transformer(cfg.model, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    logical = nnx.to_pure_dict(jax.tree.map(lambda v: v.get_metadata()["logical_axes"], state,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable)))
    return cfg, nnx.to_pure_dict(state), logical


def test_only_parameters_with_two_matrix_axes_are_decayed():
    """With zero gradients AdamW moves a parameter only by its decay: norm scales (in MoE groups too,
    where a `sublayers` axis stacks them) must not move, every matrix must shrink."""
    # moe_every=2 stacks dense layers on (layers, sublayers) and MoE layers on (layers): both kinds at once.
    cfg, params, logical = _model(["model.moe.every=2", "model.num_layers=4", "optim.weight_decay=0.5",
                                   "optim.lr=0.1", "optim.warmup_steps=0"])
    tx = make_optimizer(cfg.optim, 10, logical)

    @jax.jit
    def step(params):
        updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
        return optax.apply_updates(params, updates)

    new = step(params)
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
    flat_logical = dict(jax.tree_util.tree_flatten_with_path(logical, is_leaf=is_spec)[0])
    checked = {"matrix": 0, "vector": 0}
    for path, old in jax.tree_util.tree_flatten_with_path(params)[0]:
        moved = bool(jnp.any(new_leaf(new, path) != old))
        matrix_axes = [n for n in flat_logical[path] if n not in STACKING_AXES]
        if len(matrix_axes) >= 2:
            assert moved, f"{jax.tree_util.keystr(path)} {tuple(flat_logical[path])} was not decayed"
            checked["matrix"] += 1
        else:
            assert not moved, f"{jax.tree_util.keystr(path)} {tuple(flat_logical[path])} was decayed"
            checked["vector"] += 1
    assert checked["matrix"] and checked["vector"]
    # The case that was wrong: norm scales stacked on (layers, sublayers) were decayed.
    assert ("layers", "sublayers", "embed") in {tuple(s) for s in flat_logical.values()}


def new_leaf(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree

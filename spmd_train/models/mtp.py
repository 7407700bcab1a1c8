"""Multi-token prediction (DeepSeek-V3 report, section 2.2): extra depth that predicts tokens further ahead.

Module k (from 1) reads, at every position i, the previous depth's hidden state h^{k-1}_i (the trunk's output,
before the final norm, for k = 1) and the embedding of token t_{i+k}; it normalises both, projects their
concatenation (embedding first, as DeepSeek's checkpoints store `eh_proj`) back to d_model, runs one transformer
layer of the model's kind over it with the trunk's causal mask and positions, and its own norm plus the model's LM
head give logits for token t_{i+k+1}. The embedding and the head are the model's, shared. What each module
predicts, and which positions have a target, is `train.inputs.mtp_inputs`' business.

Details: docs/moe.md#multi-token-prediction
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from spmd_train.config.model_schema import ModelConfig
from spmd_train.models.layers import RMSNorm, dense, param
from spmd_train.models.param_specs import mtp_params
from spmd_train.models.remat import Remat, apply_remat
from spmd_train.parallel import Backends
from spmd_train.sharding.constrain import constrain

RESIDUAL = ("batch", "norm_length", "embed")


class MTP(nnx.Module):
    """model.mtp.depth modules, each stacked on a leading axis of that size (`models.param_specs.mtp_params`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, backends: Backends, block_type: type):
        depth = cfg.mtp.depth
        self.embed_norm = RMSNorm(cfg, stack=depth)
        self.hidden_norm = RMSNorm(cfg, stack=depth)
        self.eh_proj = param(rngs.params(), *mtp_params(cfg)["eh_proj"], std=cfg.init_std, dtype=cfg.param_dtype,
                             stack=depth)
        self.block = block_type(cfg, rngs, backends, stack=depth, moe=cfg.moe_every > 0)
        self.head_norm = RMSNorm(cfg, stack=depth)
        self.compute_dtype = cfg.compute_dtype

    def __call__(self, hidden: jax.Array, embedded: list[jax.Array], rope: tuple, segments: jax.Array | None,
                 kind: jax.Array | None, remat: Remat = "none") -> tuple[list[jax.Array], list[dict[str, jax.Array]]]:
        """The trunk's hidden state [batch, length, d] and each depth's embedded tokens -> (each depth's normalised
        output, ready for the LM head; each depth's layer statistics). `rope`, `segments` and `kind` as the trunk's
        layers take them (`Block`)."""
        graphdef, stacked = nnx.split(self)

        def run(params, hidden, tokens):
            module = nnx.merge(graphdef, params)
            hidden, layer_stats = module.step(hidden, tokens, rope, segments, kind)
            return hidden, constrain(module.head_norm(hidden), RESIDUAL), layer_stats

        body = apply_remat(run, remat)
        outputs, stats = [], []
        for k, tokens in enumerate(embedded):
            hidden, normed, layer_stats = body(jax.tree.map(lambda a, k=k: a[k], stacked), hidden, tokens)
            outputs.append(normed)
            stats.append(layer_stats)
        return outputs, stats

    def step(self, hidden: jax.Array, embedded: jax.Array, rope: tuple, segments: jax.Array | None,
             kind: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """One module (this one unstacked): (h^{k-1}, embedded t_{i+k}) -> (h^k before its head norm, stats)."""
        joined = jnp.concatenate([self.embed_norm(embedded), self.hidden_norm(hidden)], axis=-1)
        projected = dense("bld,de->ble", constrain(joined, ("batch", "length", "embed")), self.eh_proj,
                          self.compute_dtype)
        projected = constrain(constrain(projected, ("batch", "length", "mlp")), RESIDUAL)
        return self.block(projected, rope, segments, kind)

"""Mixture-of-experts feed-forward layer (NNX): a router, E SwiGLU experts, optional shared experts.

Each token goes to its top-k experts (`routing.route`); their outputs are summed with the renormalised gates.
Where the experts run and how tokens reach them is `parallel.expert_dispatch`'s business; this module speaks
logical axis names only. Capacity is counted per group: the tokens one device holds of the batch.

Details: docs/moe.md#expert-parallelism-the-capacity-path
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from spmd_train.config.model_schema import ModelConfig
from spmd_train.models.layers import dense, param, weight
from spmd_train.models.param_specs import moe_params
from spmd_train.ops.experts import ExpertWeights
from spmd_train.ops.routing import aux_loss, expert_counts, route, sequence_aux_loss, z_loss
from spmd_train.parallel import Backends, moe_ffn, replica_mean
from spmd_train.sharding.constrain import constrain

INPUT = ("batch", "length", "embed")
OUTPUT = ("batch", "norm_length", "embed")


class RouterBias(nnx.Variable):
    """Auxiliary-loss-free balancing's per-expert selection bias (DeepSeek-V3), kept in fp32.

    State, not a trainable parameter: it gets no gradient (routing stops it), the optimizer's
    update for it is discarded, and the train step moves it by its own rule
    (`train.balance.update_router_bias`). Living in the model's state, it travels with its layer
    through the layer scan, pipeline stages, checkpoints, generation and export.
    """


class MoE(nnx.Module):
    """Routed SwiGLU experts (+ shared experts): x [batch, length, d] -> (y [batch, length, d], stats).

    stats (fp32): `aux_loss` and `z_loss` (unweighted; the caller applies model.moe.router_aux_weight
    and router_z_weight), `dropped_fraction` (share of (token, choice) assignments dropped for lack
    of capacity) and `expert_load` [E] (assignments routed to each expert, before dropping, per
    replica: averaged over the replicas of an enclosing gradient step), and with model.moe.seq_aux_weight > 0
    `seq_aux_loss` (unweighted).
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, backends: Backends, *, stack: int | None = None):
        moe = cfg.moe
        out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
        kw = {"dtype": cfg.param_dtype, "stack": stack}
        specs = moe_params(cfg)
        self.router = param(rngs.params(), *specs["router"], std=cfg.init_std, **kw)
        self.w_gate = param(rngs.params(), *specs["w_gate"], std=cfg.init_std, **kw)
        self.w_up = param(rngs.params(), *specs["w_up"], std=cfg.init_std, **kw)
        self.w_down = param(rngs.params(), *specs["w_down"], std=out_std, **kw)
        if moe.num_shared_experts:
            self.shared_gate = param(rngs.params(), *specs["shared_gate"], std=cfg.init_std, **kw)
            self.shared_up = param(rngs.params(), *specs["shared_up"], std=cfg.init_std, **kw)
            self.shared_down = param(rngs.params(), *specs["shared_down"], std=out_std, **kw)
        if moe.router_bias:
            zeros = param(None, *specs["router_bias"], std=0.0, dtype=jnp.float32, stack=stack)
            self.router_bias = RouterBias(zeros[...], **zeros.get_metadata())
        if moe.router_logit_bias:
            self.router_logit_bias = param(None, *specs["router_logit_bias"], std=0.0, **kw)
        if moe.expert_bias:
            self.b_gate, self.b_up, self.b_down = (param(None, *specs[n], std=0.0, **kw)
                                                   for n in ("b_gate", "b_up", "b_down"))
        self.num_experts, self.k, self.score = moe.num_experts, moe.experts_per_token, moe.router_score
        self.routing = {"norm": moe.norm_topk_prob, "scaling": moe.routed_scaling_factor, "n_group": moe.n_group,
                        "topk_group": moe.topk_group, "group_score": moe.group_score}
        self.has_bias, self.seq_aux = moe.router_bias, moe.seq_aux_weight > 0
        self.logit_bias, self.expert_bias, self.limit = moe.router_logit_bias, moe.expert_bias, moe.swiglu_limit
        self.capacity_factor, self.impl = backends.capacity_factor, backends.moe
        self.num_shared = moe.num_shared_experts
        self.compute_dtype = cfg.compute_dtype

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        dt = self.compute_dtype
        x = constrain(x, INPUT)
        # The router runs in fp32: top-k is decided by small logit differences.
        logits = jnp.einsum("bld,de->ble", x.astype(jnp.float32), weight(self.router, jnp.float32))
        if self.logit_bias:
            logits = logits + weight(self.router_logit_bias, jnp.float32)
        bias = self.router_bias[...] if self.has_bias else None
        expert_idx, gates, scores = route(logits, self.k, self.score, bias=bias, **self.routing)
        biases = (self.b_gate[...], self.b_up[...], self.b_down[...]) if self.expert_bias else ()
        experts = ExpertWeights(self.w_gate[...], self.w_up[...], self.w_down[...], *biases)
        y, kept = moe_ffn(x, expert_idx, gates, experts, num_experts=self.num_experts,
                          capacity_factor=self.capacity_factor, impl=self.impl, dtype=dt, limit=self.limit,
                          groups=(self.routing["n_group"], self.routing["topk_group"]))
        if self.num_shared:
            y = y + self._shared(x)
        # Routing counts over every replica's tokens, not just this one's (see `replica_mean`):
        # the aux loss and the load metric then describe the whole batch.
        counts = replica_mean(expert_counts(expert_idx, self.num_experts).astype(jnp.float32))
        fraction = counts / math.prod(expert_idx.shape[:-1])
        stats = {
            "aux_loss": aux_loss(scores, expert_idx, fraction),
            "z_loss": z_loss(logits),
            "dropped_fraction": 1.0 - jnp.mean(kept.astype(jnp.float32)),
            "expert_load": counts,
        }
        if self.seq_aux:
            stats["seq_aux_loss"] = sequence_aux_loss(scores, expert_idx)
        return constrain(y, OUTPUT), stats

    def _shared(self, x: jax.Array) -> jax.Array:
        dt = self.compute_dtype
        gate = constrain(dense("bld,df->blf", x, self.shared_gate, dt), ("batch", "length", "mlp"))
        up = constrain(dense("bld,df->blf", x, self.shared_up, dt), ("batch", "length", "mlp"))
        return dense("blf,fd->bld", jax.nn.silu(gate) * up, self.shared_down, dt).astype(x.dtype)

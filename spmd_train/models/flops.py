"""Model FLOPs of a training step, by the convention every MFU number in this project uses.

Per token: 6 x N, with N the parameters that take part in matmuls (all parameters except
the input embedding table, whose lookup does no arithmetic; the LM head counts, tied or
not; norm scales are negligible and left out), plus attention: QK^T and PV are
2 x 2 x seq x heads x head_dim FLOPs per token per layer forward, halved for causal
masking, times 3 for forward + backward, so 6 x layers x seq x heads x head_dim.
Rematerialisation is not counted (it is overhead, not model work).

Mixture of experts: N counts the parameters a token is *active* in, not all of them. An
MoE layer's MLP contributes its router (d_model x num_experts, every token scores every
expert), the k = moe.experts_per_token experts the token is routed to (3 x d_model x moe.d_ff
each, SwiGLU) and the shared experts every token goes through (3 x d_model x moe.d_ff x
moe.num_shared_experts); the other E - k experts do no work for that token. Dense layers count
as before. Work the implementation adds on top is overhead, like remat, and not counted:
empty capacity slots (backends.moe=capacity computes every slot, filled or not), dispatch and
combine, and the all-to-alls. Dropped assignments are counted as if they ran (the model
FLOPs are those of the routing the model asked for).
"""

from __future__ import annotations

from spmd_train.config.schema import ModelConfig


def moe_layer_count(m: ModelConfig) -> int:
    """MoE layers in the model: every model.moe.every-th layer (0 without MoE)."""
    return m.num_layers // m.moe_every if m.moe_every > 0 else 0


def active_moe_mlp_params(m: ModelConfig) -> int:
    """Parameters one token is active in, in one MoE layer's MLP: router + k routed experts + shared experts."""
    if m.moe is None:
        return 0
    d, f = m.d_model, m.resolved_moe_d_ff
    router = d * m.moe.num_experts
    routed = 3 * d * f * m.moe.experts_per_token
    shared = 3 * d * f * m.moe.num_shared_experts
    return router + routed + shared


def matmul_params(m: ModelConfig) -> int:
    """Parameters used in matmuls per token: attention and (active) MLP weights of every layer, plus the LM head.

    Without MoE this is every matmul parameter; with MoE, MoE layers count their active
    parameters only (`active_moe_mlp_params`), so MFU measures the work a token really does.
    """
    hd = m.resolved_head_dim
    attention = m.d_model * hd * (2 * m.num_heads + 2 * m.num_kv_heads)
    dense_mlp = 3 * m.d_model * m.d_ff
    moe = moe_layer_count(m)
    mlp = (m.num_layers - moe) * dense_mlp + moe * active_moe_mlp_params(m)
    return m.num_layers * attention + mlp + m.d_model * m.vocab_size


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) under the convention above."""
    return 6.0 * matmul_params(m) + 6.0 * m.num_layers * seq_len * m.num_heads * m.resolved_head_dim

"""Model FLOPs of a training step, by the convention every MFU number in this project uses.

Per token: 6 x N, with N the parameters that take part in matmuls (all parameters except
the input embedding table, whose lookup does no arithmetic; the LM head counts, tied or
not; norm scales are negligible and left out), plus attention: QK^T and PV are
2 x 2 x seq x heads x head_dim FLOPs per token per layer forward, halved for causal
masking, times 3 for forward + backward, so 6 x layers x seq x heads x head_dim.
Rematerialisation is not counted (it is overhead, not model work).
"""

from __future__ import annotations

from spmd_train.config.schema import ModelConfig


def matmul_params(m: ModelConfig) -> int:
    """Parameters used in matmuls: attention and MLP weights of every layer, plus the LM head."""
    hd = m.resolved_head_dim
    attention = m.d_model * hd * (2 * m.num_heads + 2 * m.num_kv_heads)
    mlp = 3 * m.d_model * m.d_ff
    return m.num_layers * (attention + mlp) + m.d_model * m.vocab_size


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) under the convention above."""
    return 6.0 * matmul_params(m) + 6.0 * m.num_layers * seq_len * m.num_heads * m.resolved_head_dim

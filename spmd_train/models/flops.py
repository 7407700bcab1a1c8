"""Model FLOPs of a training step, by the convention every MFU number in this project uses.

Per token: 6 x the parameters that take part in matmuls (MoE: those a token is active in) plus causal
attention, 6 x layers x seq x heads x head_dim; remat and MoE dispatch overhead are not counted. Also split
per layer (`layer_flops_per_token`) for pipeline stages, and `balanced_depths`, the cheapest contiguous split.

Derivation: docs/explanation/flops-and-mfu.md
"""

from __future__ import annotations

import itertools

import numpy as np

from spmd_train.config.model_schema import ModelConfig


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


# --- per layer, and split into pipeline chunks: where the pipelined step runs each part ----------------


def layer_flops_per_token(m: ModelConfig, seq_len: int) -> np.ndarray:
    """Training FLOPs per token of each model layer (forward + backward), in model order."""
    hd = m.resolved_head_dim
    attention = 6.0 * m.d_model * hd * (2 * m.num_heads + 2 * m.num_kv_heads) + 6.0 * seq_len * m.num_heads * hd
    dense, moe = 6.0 * 3 * m.d_model * m.d_ff, 6.0 * active_moe_mlp_params(m)
    every = m.moe_every
    return np.array([attention + (moe if every and (i + 1) % every == 0 else dense) for i in range(m.num_layers)])


def head_flops_per_token(m: ModelConfig) -> float:
    """Training FLOPs per token of the LM head (the final norm aside), tied or not."""
    return 6.0 * m.d_model * m.vocab_size


def chunk_flops_per_token(m: ModelConfig, seq_len: int, depths: list[int]) -> list[float]:
    """FLOPs per token of each model chunk holding `depths[c]` consecutive layers; the last carries the head."""
    if sum(depths) != m.num_layers:
        raise ValueError(f"chunk depths {depths} do not sum to num_layers={m.num_layers}")
    bounds = np.cumsum([0, *depths])
    per_layer = layer_flops_per_token(m, seq_len)
    costs = [float(per_layer[a:b].sum()) for a, b in itertools.pairwise(bounds)]
    costs[-1] += head_flops_per_token(m)
    return costs


def balanced_depths(m: ModelConfig, seq_len: int, chunks: int) -> list[int]:
    """The split of the layers into `chunks` contiguous non-empty chunks of whole MoE groups whose costliest chunk
    (head included) costs least; the even split when no other is cheaper."""
    unit = max(m.moe_every, 1)
    n = m.num_layers // unit
    if n < chunks:
        raise ValueError(f"{n} layer groups cannot fill {chunks} chunks")
    per_layer = layer_flops_per_token(m, seq_len)
    prefix = np.concatenate([[0.0], np.cumsum(per_layer.reshape(n, unit).sum(1))])
    head = head_flops_per_token(m)
    # best[k][j]: the least max cost of splitting the first j units into k chunks; cut[k][j] the last cut.
    best = np.full((chunks + 1, n + 1), np.inf)
    cut = np.zeros((chunks + 1, n + 1), int)
    best[0][0] = 0.0
    for k in range(1, chunks + 1):
        extra = head if k == chunks else 0.0
        for j in range(k, n - (chunks - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i] + (extra if j == n else 0.0))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    depths, j = [], n
    for k in range(chunks, 0, -1):
        depths.append(int(j - cut[k][j]) * unit)
        j = int(cut[k][j])
    depths.reverse()
    if n % chunks == 0:
        even = [m.num_layers // chunks] * chunks
        if max(chunk_flops_per_token(m, seq_len, even)) <= best[chunks][n] * (1 + 1e-12):
            return even
    return depths

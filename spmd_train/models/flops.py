"""Model FLOPs of a training step, by the convention every MFU number in this project uses.

Per token: 6 x the parameters that take part in matmuls (MoE: those a token is active in) plus causal
attention, 6 x heads x (qk width + v width) x the keys a query sees on average, per layer: seq / 2 for a full
layer (6 x seq x heads x head_dim with equal widths), window - window^2 / (2 seq) for a sliding one (the band's
area over seq); MLA's scores are qk_nope_head_dim + qk_rope_head_dim wide, its weighted values v_head_dim;
remat and MoE dispatch overhead are not counted. Multi-token prediction modules (model.mtp) count as one more layer of
the model's kind with full attention each, plus their projection and the LM head they share. Also split
per layer (`layer_flops_per_token`) for pipeline stages, and `balanced_depths`, the cheapest contiguous split.

Derivation: docs/explanation/flops-and-mfu.md
"""

from __future__ import annotations

import itertools

import numpy as np

from spmd_train.config.model_schema import ModelConfig


def moe_layer_count(m: ModelConfig) -> int:
    """MoE layers in the model: every model.moe.every-th layer after the first_k_dense ones (0 without MoE)."""
    return (m.num_layers - m.first_dense) // m.moe_every if m.moe_every > 0 else 0


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
    attention = attention_matmul_params(m)
    dense_mlp = 3 * m.d_model * m.d_ff
    moe = moe_layer_count(m)
    mlp = (m.num_layers - moe) * dense_mlp + moe * active_moe_mlp_params(m)
    return m.num_layers * attention + mlp + m.d_model * m.vocab_size + mtp_matmul_params(m)


def mtp_matmul_params(m: ModelConfig) -> int:
    """Matmul parameters per token of the multi-token prediction modules: each one's projection (2 d_model wide in),
    its layer (MoE layers counting their active parameters, as above) and the LM head it shares."""
    if m.mtp is None:
        return 0
    mlp = active_moe_mlp_params(m) if m.moe_every > 0 else 3 * m.d_model * m.d_ff
    return m.mtp.depth * (2 * m.d_model * m.d_model + attention_matmul_params(m) + mlp + m.d_model * m.vocab_size)


def mtp_kind(m: ModelConfig) -> str:
    """The attention kind of the multi-token prediction modules' layers: full, unless every layer is sliding."""
    return "full" if "full" in m.attention_kinds else "sliding"


def attention_matmul_params(m: ModelConfig) -> int:
    """One layer's attention projection weights (biases, norms and sinks aside): Q, K, V and O, or MLA's latent
    down-projections, their per-head expansions and O."""
    d, h = m.d_model, m.num_heads
    a = m.mla
    if a is None:
        return d * m.resolved_head_dim * (2 * h + 2 * m.num_kv_heads)
    qk = m.resolved_head_dim
    query = d * h * qk if a.q_lora_rank is None else a.q_lora_rank * (d + h * qk)
    kv = d * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * h * (a.qk_nope_head_dim + a.v_head_dim)
    return query + kv + h * a.v_head_dim * d


def keys_per_query(window: int | None, seq_len: int) -> float:
    """Keys a query sees on average, as the convention counts them: seq / 2 under the causal mask, and with a
    window w < seq the band's area over seq, w - w^2 / (2 seq)."""
    if window is None or window >= seq_len:
        return seq_len / 2
    return window - window * window / (2 * seq_len)


def attention_flops(heads: int, head_dim: int, window: int | None, seq_len: int, v_head_dim: int | None = None
                    ) -> float:
    """Training FLOPs per token of one layer's scores (q/k `head_dim` wide) and weighted values (`v_head_dim`,
    default `head_dim`): QK^T and PV, forward + backward."""
    v = head_dim if v_head_dim is None else v_head_dim
    return 6.0 * keys_per_query(window, seq_len) * heads * (head_dim + v)


def layer_windows(m: ModelConfig) -> tuple[int | None, ...]:
    """Each layer's window in model order (None: a full layer)."""
    return tuple(m.window_of(kind) for kind in m.layer_kinds)


def window_counts(m: ModelConfig) -> tuple[tuple[int | None, int], ...]:
    """(window, how many layers have it) per attention kind, from the repeated pattern (cheap at any depth); the
    multi-token prediction modules' layers included."""
    pattern, n = m.layer_pattern, m.num_layers
    whole, rest = divmod(n, len(pattern))
    counts: dict[str, int] = {}
    for i, kind in enumerate(pattern):
        counts[kind] = counts.get(kind, 0) + whole + (i < rest)
    if m.mtp is not None:
        counts[mtp_kind(m)] = counts.get(mtp_kind(m), 0) + m.mtp.depth
    return tuple((m.window_of(kind), count) for kind, count in sorted(counts.items()) if count)


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) under the convention above."""
    hd, dv = m.resolved_head_dim, m.resolved_v_head_dim
    return 6.0 * matmul_params(m) + sum(count * attention_flops(m.num_heads, hd, w, seq_len, dv)
                                        for w, count in window_counts(m))


# --- per layer, and split into pipeline chunks: where the pipelined step runs each part ----------------


def layer_matmul_flops_per_token(m: ModelConfig) -> list[float]:
    """Training FLOPs per token of each model layer's matmuls (6 x the parameters a token passes through: attention's
    projections, then the dense MLP or the MoE layer's active part), in model order."""
    projections = 6.0 * attention_matmul_params(m)
    dense, moe = 6.0 * 3 * m.d_model * m.d_ff, 6.0 * active_moe_mlp_params(m)
    return [projections + (moe if m.is_moe_layer(i) else dense) for i in range(m.num_layers)]


def layer_flops_per_token(m: ModelConfig, seq_len: int) -> np.ndarray:
    """Training FLOPs per token of each model layer (forward + backward), in model order."""
    hd, dv = m.resolved_head_dim, m.resolved_v_head_dim
    return np.array([matmul + attention_flops(m.num_heads, hd, w, seq_len, dv)
                     for matmul, w in zip(layer_matmul_flops_per_token(m), layer_windows(m), strict=True)])


def head_flops_per_token(m: ModelConfig) -> float:
    """Training FLOPs per token of the LM head (the final norm aside), tied or not."""
    return 6.0 * m.d_model * m.vocab_size


def first_layers_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of the model.moe.first_k_dense layers, which a pipeline runs before its stages, each
    stage on its share of the rows (`train.pipelined`)."""
    return float(layer_flops_per_token(m, seq_len)[:m.first_dense].sum())


def chunk_flops_per_token(m: ModelConfig, seq_len: int, depths: list[int]) -> list[float]:
    """FLOPs per token of each model chunk holding `depths[c]` consecutive layers of those the stages hold (all but
    the first_k_dense ones); the last carries the head."""
    staged = m.num_layers - m.first_dense
    if sum(depths) != staged:
        raise ValueError(f"chunk depths {depths} do not sum to the {staged} staged layers")
    bounds = np.cumsum([0, *depths])
    per_layer = layer_flops_per_token(m, seq_len)[m.first_dense:]
    costs = [float(per_layer[a:b].sum()) for a, b in itertools.pairwise(bounds)]
    costs[-1] += head_flops_per_token(m)
    return costs


def balanced_depths(m: ModelConfig, seq_len: int, chunks: int) -> list[int]:
    """The split of the staged layers (all but the first_k_dense ones) into `chunks` contiguous non-empty chunks of
    whole MoE groups whose costliest chunk (head included) costs least; the even split when no other is cheaper."""
    unit, staged = max(m.moe_every, 1), m.num_layers - m.first_dense
    n = staged // unit
    if n < chunks:
        raise ValueError(f"{n} layer groups cannot fill {chunks} chunks")
    per_layer = layer_flops_per_token(m, seq_len)[m.first_dense:]
    units = cheapest_split(per_layer.reshape(n, unit).sum(1).tolist(), head_flops_per_token(m), chunks)
    return [k * unit for k in units]


def cheapest_split(costs: list[float], head: float, chunks: int) -> list[int]:
    """How many of the consecutive `costs` (units of work) each of `chunks` non-empty chunks takes so that the
    costliest chunk, the last one carrying `head` as well, costs least; the even split when no other is cheaper."""
    n = len(costs)
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
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
    split, j = [], n
    for k in range(chunks, 0, -1):
        split.append(int(j - cut[k][j]))
        j = int(cut[k][j])
    split.reverse()
    if n % chunks == 0:
        even = [n // chunks] * chunks
        bounds = np.cumsum([0, *even])
        worst = max(prefix[b] - prefix[a] + (head if b == n else 0.0) for a, b in itertools.pairwise(bounds))
        if worst <= best[chunks][n] * (1 + 1e-12):
            return even
    return split

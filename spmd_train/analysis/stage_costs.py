"""What each pipeline stage computes: model FLOPs per layer, per stage chunk and per device, and the most even split.

FLOPs follow `models.flops` (6 x matmul parameters per token, MoE layers by their active parameters,
plus 6 x seq x heads x head_dim of attention per layer), split by where the pipelined step runs them:
each layer on the chunk that holds it, and the LM head (6 x d_model x vocab per token, forward and
backward) on the last model chunk, right after that chunk's forward. The embedding's lookup does no
arithmetic by that convention and runs before the pipeline on every stage, so it belongs to no chunk.
The per-layer figures sum to `flops_per_token` exactly.

The executor's stages hold equal numbers of layers, so the last chunk's stage also carries the head:
`balanced_depths` gives the contiguous split (whole MoE groups) whose slowest chunk costs least.
"""

from __future__ import annotations

import itertools

import numpy as np

from spmd_train.config.schema import ModelConfig
from spmd_train.models.flops import active_moe_mlp_params


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


def device_of_chunk(chunk: int, stages: int, placement: str = "loop") -> int:
    """The pipeline stage (device) that runs model chunk `chunk`: round robin ("loop"), or the V of zb_v ("v")."""
    if placement == "v":
        return chunk if chunk < stages else 2 * stages - 1 - chunk
    return chunk % stages


def stage_shares(m: ModelConfig, seq_len: int, depths: list[int], stages: int, placement: str = "loop") -> list[float]:
    """Each stage's share of the step's model FLOPs (they sum to 1) when model chunk c holds depths[c] layers."""
    costs = chunk_flops_per_token(m, seq_len, depths)
    per_stage = [0.0] * stages
    for c, cost in enumerate(costs):
        per_stage[device_of_chunk(c, stages, placement)] += cost
    total = sum(per_stage)
    return [x / total for x in per_stage]

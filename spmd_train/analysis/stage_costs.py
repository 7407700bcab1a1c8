"""What each pipeline stage computes: the model FLOPs of its chunks (`models.flops.chunk_flops_per_token`: each
layer on the chunk that holds it, the LM head on the last model chunk), summed per device by the placement, plus an
equal share of the model.moe.first_k_dense layers, which every stage runs on its share of the rows."""

from __future__ import annotations

from spmd_train.config.model_schema import ModelConfig
from spmd_train.models.flops import chunk_flops_per_token, first_layers_flops_per_token
from spmd_train.parallel.schedules import stage_of


def stage_shares(m: ModelConfig, seq_len: int, depths: list[int], stages: int, placement: str = "loop") -> list[float]:
    """Each stage's share of the step's model FLOPs (they sum to 1) when model chunk c holds depths[c] layers."""
    per_stage = stage_flops(chunk_flops_per_token(m, seq_len, depths), first_layers_flops_per_token(m, seq_len),
                            stages, placement)
    total = sum(per_stage)
    return [x / total for x in per_stage]


def stage_flops(chunk_costs: list[float], first: float, stages: int, placement: str) -> list[float]:
    """Each stage's FLOPs: the costs of the model chunks `stage_of` places on it (the LM head's already in the last
    chunk's), plus 1/stages of `first`, the dense first layers every stage runs on its share of the rows."""
    per_stage = [first / stages] * stages
    for c, cost in enumerate(chunk_costs):
        per_stage[stage_of(c, stages, placement)] += cost
    return per_stage

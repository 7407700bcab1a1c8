"""How a candidate's pipeline lays the layers out: equal stage chunks when they divide the stack's rows, else
`parallel.pipeline_layers=balanced`'s cheapest contiguous split; the busiest stage's FLOPs against the mean, and the
padding rows the stored stack then carries (every chunk is stored as deep as the deepest)."""

from __future__ import annotations

import functools
import itertools

from spmd_train.analysis.plan.candidate import Candidate
from spmd_train.analysis.plan.shape import ModelShape
from spmd_train.analysis.stage_costs import stage_flops
from spmd_train.models.flops import cheapest_split
from spmd_train.parallel.schedules import placement_of


def stack_rows(m: ModelShape) -> int:
    """Rows of the layer stack the stages split (layers after first_dense, in groups of `stack_unit`)."""
    return len(m.staged) // m.stack_unit


def uneven(m: ModelShape, c: Candidate) -> bool:
    """Whether the candidate's stage chunks cannot all hold the same rows, so that it runs
    `parallel.pipeline_layers=balanced` (a fused schedule: split-backward ones run equal chunks only)."""
    return pipeline_layers(stack_rows(m), c) is not None


def pipeline_layers(rows: int, c: Candidate) -> str | None:
    """`parallel.pipeline_layers` of the run candidate `c` describes for a stack of `rows` rows
    (`ModelConfig.stack_rows`): balanced when its chunks cannot be equal, else null (equal chunks)."""
    return "balanced" if c.pipeline > 1 and rows % (c.pipeline * c.virtual_stages) else None


def chunk_layers(m: ModelShape, c: Candidate, seq_len: int) -> tuple[int, ...]:
    """Layers of each model chunk, in model order: equal, or `models.flops.cheapest_split` of the stack's rows by
    their FLOPs with the LM head on the last chunk (what the engine's "balanced" resolves to)."""
    return _chunk_layers(m, c.pipeline * c.virtual_stages, seq_len)


@functools.lru_cache(maxsize=4096)
def _chunk_layers(m: ModelShape, chunks: int, seq_len: int) -> tuple[int, ...]:
    rows, unit = stack_rows(m), m.stack_unit
    if rows % chunks == 0:
        return (rows // chunks * unit,) * chunks
    per_layer = m.staged_flops_per_token(seq_len)
    costs = [sum(per_layer[r * unit:(r + 1) * unit]) for r in range(rows)]
    return tuple(k * unit for k in cheapest_split(costs, m.head_flops_per_token, chunks))


def stage_imbalance(m: ModelShape, c: Candidate, seq_len: int) -> float:
    """The busiest stage's FLOPs over the mean stage's: each chunk's layers on the stage the schedule places it on,
    the LM head on the last chunk's, the first_dense layers shared evenly (1.0 without a pipeline)."""
    if c.pipeline == 1:
        return 1.0
    return _imbalance(m, c.pipeline, c.virtual_stages, c.pipeline_schedule, seq_len)


@functools.lru_cache(maxsize=4096)
def _imbalance(m: ModelShape, stages: int, virtual: int, schedule: str, seq_len: int) -> float:
    per_layer = m.staged_flops_per_token(seq_len)
    bounds = list(itertools.accumulate(_chunk_layers(m, stages * virtual, seq_len), initial=0))
    chunks = [sum(per_layer[a:b]) for a, b in itertools.pairwise(bounds)]
    chunks[-1] += m.head_flops_per_token
    # The first_dense layers: the rest of the model's FLOPs.
    per_stage = stage_flops(chunks, m.flops_per_token(seq_len) - sum(chunks), stages, placement_of(schedule))
    return max(per_stage) / (sum(per_stage) / stages)


def stored_rows_factor(m: ModelShape, c: Candidate, seq_len: int) -> float:
    """Rows the stored stack holds (every chunk as deep as the deepest) over the model's rows (1.0 when equal)."""
    if not uneven(m, c):
        return 1.0
    depths = chunk_layers(m, c, seq_len)
    return len(depths) * max(depths) / len(m.staged)

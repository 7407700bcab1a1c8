"""An engine's layout in the analytic model's terms, and what that model says of it.

`describe` and `plan --explain` print the same functions' answers (`analysis.plan.memory.estimate_memory`,
`analysis.plan.comm.comm_terms`) for the same layout: `describe` builds the layout from the engine it compiles,
the planner from the candidates it enumerates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spmd_train.analysis.plan.candidate import Candidate, Workload
from spmd_train.analysis.plan.comm import comm_terms
from spmd_train.analysis.plan.memory import estimate_memory
from spmd_train.analysis.plan.model import comm_json, memory_parts
from spmd_train.analysis.plan.shape import ModelShape


@dataclass(frozen=True)
class AnalyticLayout:
    """The model, the layout and the work of one run, as the analytic model takes them."""

    shape: ModelShape
    candidate: Candidate
    workload: Workload


def analytic_layout(engine) -> AnalyticLayout:
    """The layout an `Engine` compiles, handed to the analytic model: its mesh sizes, rules and settings."""
    cfg = engine.cfg
    platform = engine.mesh.devices.flat[0].platform
    return AnalyticLayout(shape=ModelShape.from_config(cfg.model),
                          candidate=Candidate.from_config(cfg, dict(engine.mesh.shape)),
                          workload=Workload.from_config(cfg, platform))


def analytic_section(layout: AnalyticLayout) -> dict[str, Any]:
    """What the analytic model says of a layout: memory per device by part, and every collective per step."""
    memory = estimate_memory(layout.shape, layout.candidate, layout.workload)
    terms = comm_terms(layout.shape, layout.candidate, layout.workload)
    return {"memory": memory_parts(memory), "collectives": [comm_json(t) for t in terms],
            "xla_cpu": layout.workload.xla_cpu}

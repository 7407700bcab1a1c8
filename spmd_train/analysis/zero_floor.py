"""The ZeRO floor: the fewest bytes per device per step that data parallelism and ZeRO must move for a run's weights.

Only the parameter traffic of the algorithm (weight gathers, gradient reduce-scatters and all-reduces, the
post-update parameter gather), per parameter and per set of mesh axes, with the bandwidth-optimal costs
`CollectiveOp.bytes_per_execution` uses: the analytic model's `zero_terms` as XLA:CPU partitions them (an
accelerator's compiler departs from it in ways `plan` counts), summed per collective and mesh axes.

Derivation: docs/describe.md#zero-3-on-large-slices-the-tpu-flags-and-the-zero-floor
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from spmd_train.analysis.analytic import AnalyticLayout, analytic_layout
from spmd_train.analysis.plan.comm import policy_zero_terms
from spmd_train.train.engine import Engine


@dataclass(frozen=True)
class FloorTerm:
    """The floor bytes of one kind of collective over one set of mesh axes, per device per step."""

    op: str
    """all-gather, reduce-scatter or all-reduce."""
    axes: tuple[str, ...]
    bytes: float

    def to_json(self) -> dict[str, Any]:
        """The public JSON form: {op, axes, bytes}."""
        return {"op": self.op, "axes": list(self.axes), "bytes": self.bytes}


def zero_floor(engine: Engine, layout: AnalyticLayout | None = None) -> list[FloorTerm]:
    """The ZeRO floor of `engine`'s step, one term per (collective, mesh axes), largest first (`layout`: the
    engine's `analytic_layout`, when the caller has it)."""
    a = layout or analytic_layout(engine)
    totals: dict[tuple[str, tuple[str, ...]], float] = defaultdict(float)
    # The algorithm's traffic, nothing a compiler adds.
    for t in policy_zero_terms(a.shape, a.candidate, a.workload, xla_cpu=True):
        totals[t.op, t.axes] += t.bytes
    return sorted((FloorTerm(op, axes, b) for (op, axes), b in totals.items()), key=lambda t: -t.bytes)


def floor_by_axes(terms: list[FloorTerm]) -> dict[tuple[str, ...], float]:
    """Floor bytes per set of mesh axes, all collectives together."""
    out: dict[tuple[str, ...], float] = defaultdict(float)
    for t in terms:
        out[t.axes] += t.bytes
    return dict(out)

"""A candidate's compiled figures in place of its estimates (`rescore`), with both kept to show the error.

Memory becomes the compiled peak, collective bytes the compiled bytes per set of mesh axes (shared over the
estimate's terms on them), and the step is timed again with those; a candidate the compiler refused for memory
does not fit.

Derivation: docs/explanation/planner-model.md#compiled-figures-in-place-of-estimates
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, replace

from spmd_train.analysis.plan.candidate import Workload
from spmd_train.analysis.plan.comm import CommTerm
from spmd_train.analysis.plan.model import Estimate
from spmd_train.analysis.plan.shape import ModelShape
from spmd_train.analysis.plan.timing import Timing, estimate_timing
from spmd_train.config.mesh_schema import MESH_AXES
from spmd_train.hardware import Hardware


@dataclass(frozen=True)
class Compiled:
    """One candidate compiled: the program's figures, the estimate of that same program, and the re-estimate."""

    platform: str
    """Where it was compiled: "cpu" (simulated devices) or "tpu" (libtpu)."""
    seconds: float
    peak_compiled: float | None
    """The compiled program's peak bytes per device; None when the compiler refused it for memory."""
    bytes_compiled: dict[tuple[str, ...], float]
    """Collective bytes each device sends per step, per set of mesh axes (empty where they could not be read)."""
    reference: Estimate
    """The analytic estimate of the program that was compiled (the compiling platform's workload)."""
    peak: float | None
    """Peak bytes per device on the target, from the compiled figure (None: refused)."""
    timing: Timing
    """The step re-estimated with the compiled collective bytes."""
    fits: bool
    notes: tuple[str, ...] = ()

    @property
    def memory_error(self) -> float | None:
        """(estimate - compiled) / compiled peak, for the program compiled."""
        if not self.peak_compiled:
            return None
        return self.reference.memory.peak / self.peak_compiled - 1

    def bytes_error(self) -> dict[tuple[str, ...], tuple[float, float]]:
        """Per set of mesh axes on either side: (estimated, compiled) collective bytes of the program compiled (none
        where the compiled bytes could not be read)."""
        if not self.bytes_compiled:
            return {}
        estimated = bytes_by_axes(self.reference.comm)
        return {axes: (estimated.get(axes, 0.0), self.bytes_compiled.get(axes, 0.0))
                for axes in sorted({*estimated, *self.bytes_compiled}, key=_axes_order)}


def bytes_by_axes(terms) -> dict[tuple[str, ...], float]:
    """Total bytes per set of mesh axes of a list of `CommTerm`s."""
    out: dict[tuple[str, ...], float] = defaultdict(float)
    for t in terms:
        out[t.axes] += t.bytes
    return dict(out)


def rescore(model: ModelShape, work: Workload, hw: Hardware, estimate: Estimate, reference: Estimate, *,
            platform: str, seconds: float, peak_compiled: float | None,
            collectives: Mapping[tuple[str, ...], tuple[float, int, str]] | None, replace_bytes: bool = True,
            notes: tuple[str, ...] = ()) -> Compiled:
    """The candidate of `estimate` with compiled figures: `collectives` maps mesh axes to (bytes, launches, the op
    with most of the bytes); None where they cannot be read. `replace_bytes=False` shows them beside the estimate
    without timing the step with them (where they are upper bounds)."""
    if collectives is None:
        return _with_peak(estimate, reference, hw, platform, seconds, peak_compiled, {}, estimate.timing, notes)
    shape = estimate.candidate.shape
    readable = {axes: v for axes, v in collectives.items() if all(a in MESH_AXES for a in axes)}
    if len(readable) < len(collectives):
        notes = (*notes, "collectives whose device groups could not be read are left out")
    # Groups of one device (axes of size 1, or none) move nothing between devices.
    known = {axes: v for axes, v in readable.items() if math.prod(shape[a] for a in axes) > 1}
    estimated = bytes_by_axes(estimate.comm)
    terms = []
    for t in estimate.comm:
        compiled = known.get(t.axes, (0.0, 0, ""))[0]
        terms.append(replace(t, bytes=compiled * t.bytes / estimated[t.axes] if estimated[t.axes] else 0.0))
    for axes, (nbytes, count, op) in known.items():
        if axes not in estimated:
            terms.append(CommTerm(op, axes, nbytes, max(count, 1), "compiled"))
    timing = estimate_timing(model, estimate.candidate, work, hw, terms) if replace_bytes else estimate.timing
    return _with_peak(estimate, reference, hw, platform, seconds, peak_compiled,
                      {a: v[0] for a, v in known.items()}, timing, notes)


def _with_peak(estimate: Estimate, reference: Estimate, hw: Hardware, platform: str, seconds: float,
               peak_compiled: float | None, nbytes: dict, timing: Timing, notes: tuple[str, ...]) -> Compiled:
    """The `Compiled` record, its target peak from the compiled one (docs/explanation/planner-model.md)."""
    peak = None
    if peak_compiled is not None:
        peak = peak_compiled + estimate.memory.peak - reference.memory.peak
        if reference.memory.peak != estimate.memory.peak:
            diff = estimate.memory.peak - reference.memory.peak
            size = f"{diff / 2**30:+.2f} GiB" if abs(diff) >= 2**30 else f"{diff / 2**20:+.2f} MiB"
            notes = (*notes, f"compiled on {platform}: the estimated difference to the target's program ({size}, "
                             "e.g. a fused attention kernel instead of XLA's) is added to the compiled peak")
    return Compiled(platform=platform, seconds=seconds, peak_compiled=peak_compiled, bytes_compiled=nbytes,
                    reference=reference, peak=peak, timing=timing, fits=peak is not None and peak <= hw.hbm_bytes,
                    notes=notes)


def _axes_order(axes: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(MESH_AXES.index(a) for a in axes)

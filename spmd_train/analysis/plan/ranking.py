"""The ranking of `search`: branch and bound on two lower bounds of the step time.

Compute over the bubble alone, then the time on all-fast links; only candidates that can still reach
the best `keep` get the next, dearer figure, and over several fast-link domains every slow-link
placement is timed for them (the best placement is an attribute of the candidate, not a candidate of
its own). Whatever enters the best `keep` also passes the real config checks (`rejections.real_check`).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from spmd_train.analysis.plan.candidate import Candidate, Workload, schedule_stats
from spmd_train.analysis.plan.comm import CommTerm, comm_terms
from spmd_train.analysis.plan.labels import Scope, config_for, label, scoped
from spmd_train.analysis.plan.memory import MemoryEstimate, MemoryModel
from spmd_train.analysis.plan.model import Estimate
from spmd_train.analysis.plan.rejections import Rejection, real_check
from spmd_train.analysis.plan.shape import ModelShape
from spmd_train.analysis.plan.target import Target, slow_placements
from spmd_train.analysis.plan.timing import Timing, compute_seconds, device_flops, estimate_timing, ties
from spmd_train.config.schema import Config
from spmd_train.hardware import Hardware


@dataclass(frozen=True)
class Ranked:
    """A candidate that fits, with its estimate (its best slow-link placement included)."""

    label: str
    estimate: Estimate


def rank(shape: ModelShape, work: Workload, target: Target, memory: MemoryModel, fitting: list[Candidate],
         keep: int, rejections: list[Rejection], cfg: Config) -> tuple[list[Ranked], int, int]:
    """(ranked, slower, step times computed): exact estimates for the candidates that can reach the best `keep`."""
    hw = target.hardware
    bounds: dict[tuple, float] = {}

    def bound_of(c: Candidate) -> float:
        # Most fitting candidates share their bound with many others: the key is every field it reads (the device
        # count is the target's). For an MoE model, the accumulation and the batch axes set the capacity slots.
        key = (c.remat, c.sequence, c.context_parallel, c.grad_accum, c.batch_ways, c.pipeline, c.pipeline_schedule,
               c.pipeline_microbatches, c.virtual_stages)
        if key not in bounds:
            bounds[key] = _compute_bound(shape, c, work, hw)
        return bounds[key]

    order = sorted(((bound_of(c), _order(c), c) for c in fitting), key=lambda t: t[:2])
    best: list[tuple[float, str]] = []
    ranked: dict[str, Ranked] = {}
    checked: dict[tuple[Candidate, int], Rejection | None] = {}  # the checks read no ZeRO, remat or placement
    timed = slower = 0

    def beats(step: float) -> bool:
        return len(best) < keep or step <= best[keep - 1][0]

    for i, (bound, _, c) in enumerate(order):
        if not beats(bound):  # sorted by this bound: none of the rest can reach the best `keep`
            slower += len(order) - i
            break
        mem, terms = memory.estimate(c), comm_terms(shape, c, work)
        est = estimate_with(shape, c, work, hw, mem, terms)
        timed += 1
        if not beats(est.timing.step):  # on all-fast links, so a lower bound over several domains
            slower += 1
            continue
        if target.domains > 1:
            placements = slow_placements(c.sizes, target.domains)
            timed += len(placements)
            est = min((estimate_with(shape, dataclasses.replace(c, dcn=dcn), work, hw, mem, terms)
                       for dcn in placements), key=lambda e: (e.timing.step, e.candidate.dcn))
        name = label(est.candidate)
        # The real checks for whatever enters the best `keep`; a later entry only pushes an unchecked one down.
        if len(best) < keep or (est.timing.step, name) < best[keep - 1]:
            key = (scoped(c, Scope.STRUCTURE), c.grad_accum)
            if key not in checked:
                checked[key] = real_check(config_for(cfg, est.candidate), est.candidate, target.platform)
            refused = checked[key] and dataclasses.replace(checked[key], candidate=est.candidate)
            if refused is not None:
                rejections.append(refused)
                continue
        ranked[name] = Ranked(name, est)
        bisect.insort(best, (est.timing.step, name))
    return tie_order([ranked[name] for _, name in best]), slower, timed


def tie_order(ranked: list[Ranked], timing: Callable[[Ranked], Timing] = lambda r: r.estimate.timing
              ) -> list[Ranked]:
    """`ranked` (fastest first by `timing`) with each run of layouts that tie with its first (`timing.ties`) ordered
    by communication time, then label: when the step cannot tell them apart, the one that moves less has more slack."""
    out: list[Ranked] = []
    i = 0
    while i < len(ranked):
        j = i + 1
        while j < len(ranked) and ties(timing(ranked[i]), timing(ranked[j])):
            j += 1
        out += sorted(ranked[i:j], key=lambda r: (timing(r).communication, r.label))
        i = j
    return out


def _compute_bound(shape: ModelShape, c: Candidate, work: Workload, hw: Hardware) -> float:
    """Compute over the pipeline bubble: the step time without any communication (`timing.estimate_timing`)."""
    compute = compute_seconds(shape, work, hw, device_flops(shape, c, work)[1])
    if c.pipeline == 1 or hw.simulated:  # simulated devices' bubble costs no time (`timing`)
        return compute
    bubble = schedule_stats(c.pipeline_schedule, c.pipeline, c.pipeline_microbatches, c.virtual_stages)[1]
    return compute / (1 - bubble)


def _order(c: Candidate) -> tuple:
    """A total order of candidates that is cheap to compute (ties in time are broken by it, then by label)."""
    return (c.sizes, c.zero_stage, c.remat, c.sequence_parallel, c.context_parallel, c.pipeline_schedule,
            c.virtual_stages, c.pipeline_microbatches or 0, c.grad_accum)


def estimate_with(shape: ModelShape, c: Candidate, work: Workload, hw: Hardware, mem: MemoryEstimate,
                  terms: list[CommTerm]) -> Estimate:
    """The estimate of `c` from its memory and collectives (neither depends on the slow-link placement)."""
    timing = estimate_timing(shape, c, work, hw, terms)
    return Estimate(candidate=c, memory=mem, comm=tuple(terms), timing=timing, fits=mem.peak <= hw.hbm_bytes)

"""The search: every layout of a config on a target, pruned by divisibility and memory, ranked by step time.

Enumerated outermost first, so a refusal at one level skips everything below it; each refusal is
recorded once, at the scope it was decided (`labels.Scope`):
1. mesh: every factorization of the device count over the six axes, refused by the rules
   `rules.mesh_reason` mirrors from the config checks, or when the outer axes cannot take the
   slow-link factors (`devices.slow_placements`);
2. structure: sequence parallelism (tensor > 1), the context scheme (sequence > 1), the pipeline
   schedule (1f1b, gpipe, interleaved with 2 or 4 virtual stages) with p, 2p, 4p or 8p microbatches;
   gpipe is recorded as dominated by 1f1b with the same microbatches (the same ticks, so the same
   bubble and sends, and a stash of all microbatches instead of at most p);
3. ZeRO stage 0-3 (one program when no axis is a ZeRO axis), refused when the state alone overflows;
4. remat policy x grad accumulation (the divisors of a device's rows): the peak falls as accumulation
   grows from 2 on, so the smallest accumulation that fits is found by bisection, the smaller ones
   recorded as not fitting and the larger ones as dominated: they change no FLOPs and only add
   collective launches (ZeRO-3 gathers per microbatch), so the model never finds them faster
   (tests/test_plan_search.py checks both claims on samples). The peaks come from parts memoized by the fields
   each reads (`memory.MemoryModel`), and candidates that differ in nothing memory reads share their fits.
Ranking is branch and bound on two lower bounds of the step time: compute over the bubble alone, then
the time on all-fast links; only candidates that can still reach the best `keep` get the next, dearer
figure, and over several fast-link domains every slow-link placement is timed for them (the best
placement is an attribute of the candidate, not a candidate of its own). Whatever enters the best
`keep` also passes the real config checks (`rules.real_check`).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from spmd_train.analysis.plan.candidate import (
    CONTEXT_SCHEMES,
    REMAT_POLICIES,
    Candidate,
    Workload,
    rows_per_device,
    schedule_stats,
)
from spmd_train.analysis.plan.comm import CommTerm, comm_terms
from spmd_train.analysis.plan.devices import Target, slow_placements
from spmd_train.analysis.plan.labels import Scope, canonical, config_for, label, scoped
from spmd_train.analysis.plan.memory import MemoryEstimate, MemoryModel, context_scheme, estimate_memory, state_bytes
from spmd_train.analysis.plan.model import Estimate
from spmd_train.analysis.plan.rules import (
    FIT,
    Rejection,
    check_default_rules,
    factorizations,
    mesh_reason,
    real_check,
    redundant_reason,
    structure_reason,
    zero_reason,
)
from spmd_train.analysis.plan.shape import ModelShape
from spmd_train.analysis.plan.timing import Timing, achievable_fraction, device_flops, estimate_timing, ties
from spmd_train.config.checks import check_attention
from spmd_train.config.schema import Config
from spmd_train.errors import ConfigError
from spmd_train.hardware import Hardware

GiB = 2**30
DOMINATED = "dominated: a smaller grad_accum fits"
GPIPE = "dominated: 1f1b runs the same ticks with a smaller stash"
KEEP = 20
"""Candidates ranked exactly by default: the table's top and the compile stage draw from these."""
PIPELINES = (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4))
MICROBATCHES = (1, 2, 4, 8)
"""Pipeline microbatches per flush, as multiples of the stages."""


@dataclass(frozen=True)
class Ranked:
    """A candidate that fits, with its estimate (its best slow-link placement included)."""

    label: str
    estimate: Estimate


@dataclass(frozen=True)
class SearchResult:
    """The outcome of `search`: the ranked candidates, every rejection, and what the search cost."""

    cfg: Config
    target: Target
    shape: ModelShape
    workload: Workload
    ranked: tuple[Ranked, ...]
    """Exact estimates, fastest first (ties by less communication, then label); at least the best `keep` that fit."""
    rejections: tuple[Rejection, ...]
    slower: int
    """Fitting candidates not ranked exactly: a lower bound of their step time is above the best `keep`'s."""
    meshes: int
    candidates: int
    """Every candidate accounted for: ranked, slower, and what each rejection stands for."""
    evaluations: int
    """Memory estimates and step-time estimates the analytic stage made (one that serves several candidates, which
    differ only in fields it does not read, counts for each)."""
    seconds: float

    @property
    def rate(self) -> float:
        """Candidates accounted for per second of the analytic stage."""
        return self.candidates / self.seconds if self.seconds else float("inf")

    def counts(self) -> list[tuple[str, str, int, str]]:
        """(rule, kind, candidates, an example's detail) per rejection rule, most candidates first."""
        total, first = Counter(), {}
        for r in self.rejections:
            total[r.rule] += r.count
            first.setdefault(r.rule, r)
        return [(rule, first[rule].kind, n, first[rule].detail) for rule, n in total.most_common()]

    def rejection(self, c: Candidate) -> Rejection | None:
        """The rejection that covers candidate `c` (at whatever scope it was decided), or None."""
        index = self.__dict__.get("_index")
        if index is None:  # frozen: the index is built once, on first use
            index = {}
            for r in self.rejections:
                index.setdefault((r.scope, r.candidate), []).append(r)
            self.__dict__["_index"] = index
        c = canonical(c)
        for scope in Scope:
            for r in index.get((scope, scoped(c, scope)), ()):
                if not r.accums or c.grad_accum in r.accums:
                    return r
        return None

    def closest(self) -> Rejection | None:
        """The memory rejection with the smallest estimated peak (what "fits nowhere" reports)."""
        sized = [r for r in self.rejections if r.peak is not None]
        return min(sized, key=lambda r: r.peak) if sized else None


def search(cfg: Config, target: Target, *, keep: int = KEEP) -> SearchResult:
    """Every candidate layout of `cfg` on `target`, rejected with one reason or ranked by estimated step time."""
    start = time.perf_counter()
    if target.hardware.peak_flops <= 0:
        raise ConfigError(f"--hardware {target.hardware.kind} has no nominal figures: its compute, memory and links "
                          "are this host's, measured (valid: `spmd-train bench-collectives --simulate-devices N --mesh "
                          "... --out FILE`, then plan with --profile FILE)")
    check_default_rules(cfg)
    check_attention(cfg, target.platform)
    shape, work = ModelShape.from_config(cfg.model), Workload.from_config(cfg, target.platform)
    hbm, memory = target.hardware.hbm_bytes, MemoryModel(shape, work)
    fits: dict[tuple, tuple[_Fit, ...]] = {}
    rejections: list[Rejection] = []
    fitting: list[Candidate] = []
    meshes = evaluations = 0
    for sizes in factorizations(target.devices):
        meshes += 1
        mesh = Candidate(*sizes)
        reason = mesh_reason(cfg, shape, mesh, target)
        if reason is not None:
            rejections.append(reason)
            continue
        for c in _structures(mesh):
            reason = structure_reason(cfg, shape, c) or _gpipe_reason(c)
            if reason is not None:
                rejections.append(reason)
                continue
            for stage in (0,) if c.fsdp * c.sequence == 1 else (0, 1, 2, 3):
                z = _derive(c, zero_stage=stage)
                reason = zero_reason(shape, z) or redundant_reason(cfg, z) or _state_reason(shape, z, work, hbm)
                if reason is not None:
                    rejections.append(reason)
                    continue
                evaluations += _fit_accumulation(memory, z, work, hbm, fitting, rejections, fits)
    ranked, slower, timed = _rank(shape, work, target, memory, fitting, keep, rejections, cfg)
    candidates = len(ranked) + slower + sum(r.count for r in rejections)
    return SearchResult(cfg=cfg, target=target, shape=shape, workload=work, ranked=tuple(ranked),
                        rejections=tuple(rejections), slower=slower, meshes=meshes, candidates=candidates,
                        evaluations=evaluations + timed, seconds=time.perf_counter() - start)


def _structures(mesh: Candidate) -> Iterator[Candidate]:
    """The mesh with each sequence-parallel, context and pipeline setting that applies to it."""
    p = mesh.pipeline
    pipelines = [(s, v, k * p) for s, v in PIPELINES for k in MICROBATCHES] if p > 1 else [("1f1b", 1, None)]
    for sp in (False, True) if mesh.tensor > 1 else (False,):
        for cp in CONTEXT_SCHEMES if mesh.sequence > 1 else ("allgather",):
            for schedule, virtual, micro in pipelines:
                yield _derive(mesh, sequence_parallel=sp, context_parallel=cp, pipeline_schedule=schedule,
                              virtual_stages=virtual, pipeline_microbatches=micro)


def _gpipe_reason(c: Candidate) -> Rejection | None:
    if c.pipeline_schedule != "gpipe":
        return None
    return Rejection(c, Scope.STRUCTURE, GPIPE, f"pp=gpipe m={c.pipeline_microbatches}: pp=1f1b with the same "
                     "microbatches has its ticks and a stash of at most pipeline microbatches", "dominated")


def _state_reason(shape: ModelShape, c: Candidate, work: Workload, hbm: float) -> Rejection | None:
    """A ZeRO stage whose parameters, gradients and optimizer state alone overflow HBM."""
    state = sum(state_bytes(shape, c, work))
    if state <= hbm:
        return None
    return Rejection(c, Scope.ZERO, FIT, f"does not fit: the state alone needs {state / GiB:.1f} GiB > "
                     f"{hbm / GiB:.1f} GiB", "memory", peak=state)


def _fit_accumulation(memory: MemoryModel, z: Candidate, work: Workload, hbm: float, fitting: list[Candidate],
                      rejections: list[Rejection], cache: dict[tuple, tuple[_Fit, ...]]) -> int:
    """Per remat policy, the smallest grad accumulation that fits; returns the memory estimates made."""
    accums = _accumulations(work.global_batch // z.batch_ways, z.pipeline_microbatches or 1)
    remats = [_derive(z, remat=remat) for remat in REMAT_POLICIES]
    # Memory reads these fields of `z` (`MemoryModel`): candidates that differ only in others share their fits.
    key = (z.sizes, z.zero_stage, z.sequence_parallel, context_scheme(z), z.pipeline_schedule, z.pipeline_microbatches,
           z.virtual_stages)
    fits = cache.get(key)
    if fits is None:
        fits = cache[key] = tuple(_fit(memory, r, accums, hbm) for r in remats)
    for r, fit in zip(remats, fits, strict=True):
        if fit.first > 0:
            rejections.append(Rejection(r, Scope.REMAT, FIT, fit.too_big, "memory", accums=accums[:fit.first],
                                        peak=fit.peak))
        if fit.first < len(accums):
            fitting.append(_derive(r, grad_accum=accums[fit.first]) if accums[fit.first] > 1 else r)
            if fit.dominated is not None:
                rejections.append(Rejection(r, Scope.REMAT, DOMINATED, fit.dominated, "dominated",
                                            accums=accums[fit.first + 1:]))
    return sum(fit.made for fit in fits)  # an estimate shared by several candidates counts for each


class _Fit(NamedTuple):
    """Where one remat policy's accumulations start to fit: `first` indexes the smallest that fits (their number when
    none does); `too_big` and `dominated` detail the rejections of those before and after it (None when there are
    none), `peak` is the smallest peak estimated before it and `made` the memory estimates made."""

    first: int
    too_big: str | None
    peak: float | None
    dominated: str | None
    made: int


def _fit(memory: MemoryModel, r: Candidate, accums: tuple[int, ...], hbm: float) -> _Fit:
    """`_Fit` of the remat-level candidate `r`, whose grad accumulation may be any of `accums`."""
    peaks: dict[int, float] = {}  # accumulation index -> peak, in the order asked

    def peak(i: int) -> float:
        if i not in peaks:
            peaks[i] = memory.peak(r, accums[i])
        return peaks[i]

    last = len(accums) - 1
    first = _first_fit(peak, last, hbm)
    too_big = near = dominated = None
    if first > 0:
        near = min((i for i in peaks if i < first), key=peaks.__getitem__)
        too_big = (f"does not fit: accum={_span(accums[:first])} need {peaks[near] / GiB:.1f} GiB or more "
                   f"(accum={accums[near]}) > {hbm / GiB:.1f} GiB")
    if first < last:
        dominated = f"dominated: accum={accums[first]} fits, and a larger grad_accum is never faster"
    return _Fit(first, too_big, None if near is None else peaks[near], dominated, len(peaks))


def _first_fit(peak: Callable[[int], float], last: int, hbm: float) -> int:
    """The index of the smallest accumulation whose `peak` fits `hbm`, `last + 1` when none does."""
    if peak(0) <= hbm:
        return 0
    if peak(last) > hbm:  # the most accumulation does not fit: none does
        return last + 1
    low, high = 1, last  # from accumulation 2 on, the peak only falls (one more gradient buffer is there from 2 on)
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if peak(mid) <= hbm else (mid + 1, high)
    return low


@functools.lru_cache(maxsize=1024)
def _accumulations(rows: int, micro: int) -> tuple[int, ...]:
    """The grad accumulations that split `rows` rows per device into whole steps of `micro` pipeline microbatches."""
    return tuple(g for g in range(1, rows + 1) if rows % g == 0 and (rows // g) % micro == 0)


def _derive(c: Candidate, **fields) -> Candidate:
    """`c` with other structure, ZeRO, remat or accumulation settings, without `dataclasses.replace`'s validation.

    The search makes about half a million of these, and replace's __init__ and checks took half of its
    time; these fields are drawn from their valid values and leave the sizes (and the cached properties that
    follow from them) as they are.
    """
    assert fields.keys() <= _DERIVED
    new = object.__new__(Candidate)
    new.__dict__.update(c.__dict__)
    new.__dict__.update(fields)
    return new


_DERIVED = frozenset({"sequence_parallel", "context_parallel", "pipeline_schedule", "virtual_stages",
                      "pipeline_microbatches", "zero_stage", "remat", "grad_accum"})


def _span(values: tuple[int, ...]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}..{values[-1]}"


def _rank(shape: ModelShape, work: Workload, target: Target, memory: MemoryModel, fitting: list[Candidate],
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
        est = _estimate(shape, c, work, hw, mem, terms)
        timed += 1
        if not beats(est.timing.step):  # on all-fast links, so a lower bound over several domains
            slower += 1
            continue
        if target.domains > 1:
            placements = slow_placements(c.sizes, target.domains)
            timed += len(placements)
            est = min((_estimate(shape, dataclasses.replace(c, dcn=dcn), work, hw, mem, terms) for dcn in placements),
                      key=lambda e: (e.timing.step, e.candidate.dcn))
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
    compute = device_flops(shape, c, work)[1] / (hw.peak_flops * achievable_fraction(hw))
    if c.pipeline == 1 or hw.simulated:  # simulated devices' bubble costs no time (`timing`)
        return compute
    bubble = schedule_stats(c.pipeline_schedule, c.pipeline, c.pipeline_microbatches, c.virtual_stages)[1]
    return compute / (1 - bubble)


def _order(c: Candidate) -> tuple:
    """A total order of candidates that is cheap to compute (ties in time are broken by it, then by label)."""
    return (c.sizes, c.zero_stage, c.remat, c.sequence_parallel, c.context_parallel, c.pipeline_schedule,
            c.virtual_stages, c.pipeline_microbatches or 0, c.grad_accum)


def _estimate(shape: ModelShape, c: Candidate, work: Workload, hw: Hardware, mem: MemoryEstimate,
              terms: list[CommTerm]) -> Estimate:
    """The estimate of `c` from its memory and collectives (neither depends on the slow-link placement)."""
    timing = estimate_timing(shape, c, work, hw, terms)
    return Estimate(candidate=c, memory=mem, comm=tuple(terms), timing=timing, fits=mem.peak <= hw.hbm_bytes)


def evaluate(result: SearchResult, c: Candidate) -> Estimate:
    """The estimate of any candidate on the result's target (its best slow-link placement when it names none)."""
    c = canonical(c)
    shape, work, target = result.shape, result.workload, result.target
    if c.devices != target.devices:
        raise ConfigError(f"layout {label(c)} spans {c.devices} devices; the plan is for {target.devices}")
    if rows_per_device(c, work) < 1:
        raise ConfigError(f"layout {label(c)} leaves no row of global_batch_size={work.global_batch} per device")
    named = math.prod(c.dcn)
    if named > 1 and named != target.domains:
        raise ConfigError(f"layout {label(c)} puts {named} slow-link factors on the mesh; {target.describe()} has "
                          f"{target.domains} fast-link domain{'s' if target.domains > 1 else ''}")
    mem, terms = estimate_memory(shape, c, work), comm_terms(shape, c, work)
    placements = [c.dcn] if named > 1 else slow_placements(c.sizes, target.domains) or [c.dcn]
    return min((_estimate(shape, dataclasses.replace(c, dcn=d), work, target.hardware, mem, terms)
                for d in placements), key=lambda e: (e.timing.step, e.candidate.dcn))

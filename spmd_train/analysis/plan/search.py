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
   (tests/test_plan_search.py checks both claims on samples).
Ranking is branch and bound on two lower bounds of the step time: compute over the bubble alone, then
the time on all-fast links; only candidates that can still reach the best `keep` get the next, dearer
figure, and over several fast-link domains every slow-link placement is timed for them (the best
placement is an attribute of the candidate, not a candidate of its own). Whatever enters the best
`keep` also passes the real config checks (`rules.real_check`).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

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
from spmd_train.analysis.plan.memory import MemoryEstimate, estimate_memory, state_bytes
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
from spmd_train.analysis.plan.timing import achievable_fraction, device_flops, estimate_timing
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
    """Exact estimates, fastest first (ties broken by label); at least the best `keep` that fit."""
    rejections: tuple[Rejection, ...]
    slower: int
    """Fitting candidates not ranked exactly: a lower bound of their step time is above the best `keep`'s."""
    meshes: int
    candidates: int
    """Every candidate accounted for: ranked, slower, and what each rejection stands for."""
    evaluations: int
    """Memory estimates and step-time estimates the analytic stage computed."""
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
    check_default_rules(cfg)
    check_attention(cfg, target.platform)
    shape, work = ModelShape.from_config(cfg.model), Workload.from_config(cfg, target.platform)
    hbm = target.hardware.hbm_bytes
    rejections: list[Rejection] = []
    fitting: list[tuple[Candidate, MemoryEstimate]] = []
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
                evaluations += _fit_accumulation(shape, z, work, hbm, fitting, rejections)
    ranked, slower, timed = _rank(shape, work, target, fitting, keep, rejections, cfg)
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
                yield dataclasses.replace(mesh, sequence_parallel=sp, context_parallel=cp, pipeline_schedule=schedule,
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


def _fit_accumulation(shape: ModelShape, z: Candidate, work: Workload, hbm: float,
                      fitting: list[tuple[Candidate, MemoryEstimate]], rejections: list[Rejection]) -> int:
    """Per remat policy, the smallest grad accumulation that fits; returns the memory estimates made."""
    rows = work.global_batch // z.batch_ways
    micro = z.pipeline_microbatches or 1
    accums = tuple(g for g in range(1, rows + 1) if rows % g == 0 and (rows // g) % micro == 0)
    made = 0
    for remat in REMAT_POLICIES:
        r = _derive(z, remat=remat)
        memo: dict[int, tuple[Candidate, MemoryEstimate]] = {}

        def peak(i: int, r=r, memo=memo) -> float:
            if i not in memo:
                c = _derive(r, grad_accum=accums[i]) if accums[i] > 1 else r
                memo[i] = (c, estimate_memory(shape, c, work))
            return memo[i][1].peak

        last = len(accums) - 1
        if peak(0) <= hbm:
            first = 0
        elif peak(last) > hbm:  # the most accumulation does not fit: none does
            first = last + 1
        else:  # from accumulation 2 on, the peak only falls (one more gradient buffer is there from 2 on)
            low, high = 1, last
            while low < high:
                mid = (low + high) // 2
                low, high = (low, mid) if peak(mid) <= hbm else (mid + 1, high)
            first = low
        made += len(memo)
        if first > 0:
            near = min((i for i in memo if i < first), key=lambda i: memo[i][1].peak)
            rejections.append(Rejection(r, Scope.REMAT, FIT, f"does not fit: accum={_span(accums[:first])} need "
                                        f"{memo[near][1].peak / GiB:.1f} GiB or more (accum={accums[near]}) > "
                                        f"{hbm / GiB:.1f} GiB", "memory", accums=accums[:first],
                                        peak=memo[near][1].peak))
        if first <= last:
            fitting.append(memo[first])
            if first < last:
                rejections.append(Rejection(r, Scope.REMAT, DOMINATED, f"dominated: accum={accums[first]} fits, "
                                            "and a larger grad_accum is never faster", "dominated",
                                            accums=accums[first + 1:]))
    return made


def _derive(c: Candidate, **fields) -> Candidate:
    """`c` with other ZeRO, remat or accumulation settings, without `dataclasses.replace`'s validation.

    The search makes about a quarter of a million of these, and replace's __init__ and checks took half of its
    time; these fields are drawn from their valid values and leave the sizes (and the cached properties that
    follow from them) as they are.
    """
    assert fields.keys() <= {"zero_stage", "remat", "grad_accum"}
    new = object.__new__(Candidate)
    new.__dict__.update(c.__dict__)
    new.__dict__.update(fields)
    return new


def _span(values: tuple[int, ...]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}..{values[-1]}"


def _rank(shape: ModelShape, work: Workload, target: Target, fitting: list[tuple[Candidate, MemoryEstimate]],
          keep: int, rejections: list[Rejection], cfg: Config) -> tuple[list[Ranked], int, int]:
    """(ranked, slower, step times computed): exact estimates for the candidates that can reach the best `keep`."""
    hw = target.hardware
    order = sorted(((_compute_bound(shape, c, work, hw), _order(c), c, mem) for c, mem in fitting),
                   key=lambda t: t[:2])
    best: list[tuple[float, str]] = []
    ranked: dict[str, Ranked] = {}
    checked: dict[tuple[Candidate, int], Rejection | None] = {}  # the checks read no ZeRO, remat or placement
    timed = slower = 0

    def beats(step: float) -> bool:
        return len(best) < keep or step <= best[keep - 1][0]

    for i, (bound, _, c, mem) in enumerate(order):
        if not beats(bound):  # sorted by this bound: none of the rest can reach the best `keep`
            slower += len(order) - i
            break
        terms = comm_terms(shape, c, work)
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
    return [ranked[name] for _, name in best], slower, timed


def _compute_bound(shape: ModelShape, c: Candidate, work: Workload, hw: Hardware) -> float:
    """Compute over the pipeline bubble: the step time without any communication (`timing.estimate_timing`)."""
    compute = device_flops(shape, c, work)[1] / (hw.peak_flops * achievable_fraction(hw))
    if c.pipeline == 1:
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

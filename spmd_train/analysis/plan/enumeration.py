"""The enumeration of `search`: every layout of a config on a target, pruned by divisibility and memory.

Enumerated outermost first (mesh, structure, ZeRO stage, remat policy x grad accumulation), so a refusal at one
level skips everything below it; each refusal is recorded once, at the scope it was decided (`labels.Scope`).

Derivation: docs/explanation/planner-model.md#the-enumeration
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import NamedTuple

from spmd_train.analysis.plan.candidate import (
    CONTEXT_SCHEMES,
    Candidate,
    Workload,
    less_offloaded,
    searched_settings,
)
from spmd_train.analysis.plan.labels import Scope
from spmd_train.analysis.plan.memory import MemoryModel, context_scheme, state_bytes
from spmd_train.analysis.plan.rejections import (
    FIT,
    Rejection,
    factorizations,
    mesh_reason,
    redundant_reason,
    structure_reason,
    zero_reason,
)
from spmd_train.analysis.plan.shape import ModelShape
from spmd_train.analysis.plan.target import Target
from spmd_train.config.schema import Config
from spmd_train.units import gib_apart

DOMINATED = "dominated: a smaller grad_accum fits"
GPIPE = "dominated: 1f1b runs the same ticks with a smaller stash"
OFFLOADED = "dominated: fits without the offload at the same grad_accum"
PIPELINES = (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4))
MICROBATCHES = (1, 2, 4, 8)
"""Pipeline microbatches per flush, as multiples of the stages."""


class Enumerated(NamedTuple):
    """What the enumeration leaves for ranking: the candidates that fit, every rejection, and what it cost."""

    fitting: list[Candidate]
    rejections: list[Rejection]
    meshes: int
    evaluations: int
    """Memory estimates made (one shared by several candidates counts for each)."""


def enumerate_fitting(cfg: Config, shape: ModelShape, work: Workload, target: Target,
                      memory: MemoryModel) -> Enumerated:
    """Every candidate layout of `cfg` on `target`: those that fit, with the smallest fitting accumulation, and the
    rejections of the rest."""
    hbm = target.hardware.hbm_bytes
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
                reason = (zero_reason(shape, z) or redundant_reason(cfg, z)
                          or _state_reason(shape, z, work, hbm, memory))
                if reason is not None:
                    rejections.append(reason)
                    continue
                evaluations += _fit_accumulation(memory, z, work, hbm, fitting, rejections, fits)
    return Enumerated(fitting, rejections, meshes, evaluations)


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


def _state_reason(shape: ModelShape, c: Candidate, work: Workload, hbm: float, memory: MemoryModel
                  ) -> Rejection | None:
    """A ZeRO stage whose parameters, gradients and optimizer state alone overflow HBM (what stays on the device of
    the optimizer state offloaded, where the search offloads it)."""
    state = sum(state_bytes(shape, c, work))
    if state <= hbm:
        return None
    offloaded = ""
    if work.offloads_state:
        state = memory.state_on_device(_derive(c, offload=1.0))
        if state <= hbm:
            return None
        offloaded = " with the optimizer state offloaded"
    need, limit = gib_apart(state, hbm)
    return Rejection(c, Scope.ZERO, FIT, f"does not fit: the state alone needs {need}{offloaded} > {limit}",
                     "memory", peak=state)


def _fit_accumulation(memory: MemoryModel, z: Candidate, work: Workload, hbm: float, fitting: list[Candidate],
                      rejections: list[Rejection], cache: dict[tuple, tuple[_Fit, ...]]) -> int:
    """Per remat policy and offload, the smallest grad accumulation that fits; returns the memory estimates made.
    An offloading setting is kept only where it fits at a smaller accumulation than every less offloaded one (the
    offload adds host transfers and saves nothing else)."""
    accums = _accumulations(work.global_batch // z.batch_ways, z.pipeline_microbatches or 1)
    settings = searched_settings(z, work)
    remats = [_derive(z, remat=remat, offload=share) for remat, share in settings]
    # Memory reads these fields of `z` (`MemoryModel`): candidates that differ only in others share their fits.
    key = (z.sizes, z.zero_stage, z.sequence_parallel, context_scheme(z), z.pipeline_schedule, z.pipeline_microbatches,
           z.virtual_stages)
    fits = cache.get(key)
    if fits is None:
        fits = cache[key] = tuple(_fit(memory, r, accums, hbm) for r in remats)
    first = dict(zip(settings, (fit.first for fit in fits), strict=True))
    for r, setting, fit in zip(remats, settings, fits, strict=True):
        if fit.first > 0:
            rejections.append(Rejection(r, Scope.REMAT, FIT, fit.too_big, "memory", accums=accums[:fit.first],
                                        peak=fit.peak))
        plainer = [p for p in less_offloaded(*setting) if first.get(p, len(accums)) <= fit.first]
        if fit.first < len(accums) and plainer:
            remat, share = plainer[0]
            rejections.append(Rejection(r, Scope.REMAT, OFFLOADED, f"dominated: remat={remat}"
                                        f"{' offload' if share else ''} fits at accum={accums[fit.first]} too, "
                                        "without this offload's host transfers", "dominated",
                                        accums=accums[fit.first:]))
        elif fit.first < len(accums):
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
        need, limit = gib_apart(peaks[near], hbm)
        too_big = f"does not fit: accum={_span(accums[:first])} need {need} or more (accum={accums[near]}) > {limit}"
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
                      "pipeline_microbatches", "zero_stage", "remat", "offload", "grad_accum"})


def _span(values: tuple[int, ...]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}..{values[-1]}"

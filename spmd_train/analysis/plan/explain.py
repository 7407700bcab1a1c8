"""`plan --explain LABEL`: the layout a label names, with the settings it leaves out chosen as the search would.

A label may name the mesh alone (`fsdp=32 tensor=8`) or some settings (`| zero3 remat=full`): the ZeRO stage,
remat policy, optimizer offload and grad accumulation it does not give are tried, and the fastest combination that
fits is explained (the one with the smallest peak when none fits), so an explanation never judges one accumulation only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from spmd_train.analysis.plan.candidate import REMAT_POLICIES, Candidate, searched_settings
from spmd_train.analysis.plan.model import Estimate
from spmd_train.analysis.plan.rejections import Rejection
from spmd_train.analysis.plan.search import SearchResult, evaluate

RUNS = ("dominated",)
"""Rejection kinds of layouts that run (another one is never slower): they are explained, not refused."""


@dataclass(frozen=True)
class Explained:
    """What `--explain` reports: an estimate (and why it was not ranked, if it was not), or a refusal."""

    estimate: Estimate | None
    rejection: Rejection | None
    """Why the explained layout is not ranked (dominated), or why the label's layout cannot run."""
    tried: int
    """Settings combinations judged for the label."""


def explain(result: SearchResult, asked: Candidate, given: frozenset[str]) -> Explained:
    """The layout `asked` names, its settings outside `given` chosen as the best fitting (see the module)."""
    runnable: list[tuple[Estimate, Rejection | None]] = []
    first_refusal = result.rejection(asked)
    tried = 0
    for c in _variants(result, asked, given):
        tried += 1
        rejected = result.rejection(c)
        if rejected is not None and rejected.kind not in (*RUNS, "memory"):
            continue
        runnable.append((evaluate(result, c), rejected if rejected is not None and rejected.kind in RUNS else None))
    if not runnable:
        return Explained(None, first_refusal, tried)
    fitting = [r for r in runnable if r[0].fits]
    if fitting:
        est, why = min(fitting, key=lambda r: (r[0].timing.step, _order(r[0].candidate)))
    else:
        est, why = min(runnable, key=lambda r: (r[0].memory.peak, _order(r[0].candidate)))
    return Explained(est, why, tried)


def _variants(result: SearchResult, asked: Candidate, given: frozenset[str]):
    stages = (asked.zero_stage,) if "zero_stage" in given else (0, 1, 2, 3)
    settings = searched_settings(asked, result.workload)
    remats = (asked.remat,) if "remat" in given else tuple(dict.fromkeys(r for r, _ in settings))
    # The offload is decided with the remat policy: a label that gives the policy and no offload names none (as a
    # label the search prints does).
    shares = ((asked.offload,) if given & {"offload", "remat"} else tuple(dict.fromkeys(s for _, s in settings)))
    rows = result.workload.global_batch // asked.batch_ways
    accums = (asked.grad_accum,) if "grad_accum" in given else [a for a in range(1, rows + 1) if rows % a == 0]
    for stage in stages:
        for remat in remats:
            for share in shares:
                for accum in accums:
                    yield dataclasses.replace(asked, zero_stage=stage, remat=remat, offload=share, grad_accum=accum)


def _order(c: Candidate) -> tuple:
    """Ties go to the simplest settings: the least accumulation, the least remat, no offload, the lowest ZeRO stage."""
    return c.grad_accum, REMAT_POLICIES.index(c.remat), c.offload, c.zero_stage

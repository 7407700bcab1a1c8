"""The search: every layout of a config on a target, pruned by divisibility and memory, ranked by step time.

The enumeration and its pruning are `enumeration.py`'s, the branch-and-bound ranking `ranking.py`'s; this
module runs both and answers questions about the result (`SearchResult`, `evaluate`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from dataclasses import dataclass

from spmd_train.analysis.plan.candidate import Candidate, Workload, rows_per_device
from spmd_train.analysis.plan.comm import comm_terms
from spmd_train.analysis.plan.enumeration import enumerate_fitting
from spmd_train.analysis.plan.labels import Scope, canonical, label, scoped
from spmd_train.analysis.plan.memory import MemoryModel, estimate_memory
from spmd_train.analysis.plan.model import Estimate
from spmd_train.analysis.plan.ranking import Ranked, estimate_with, rank
from spmd_train.analysis.plan.rejections import Rejection, check_default_rules
from spmd_train.analysis.plan.shape import ModelShape
from spmd_train.analysis.plan.target import Target, slow_placements
from spmd_train.config.checks import check_attention
from spmd_train.config.schema import Config
from spmd_train.errors import ConfigError

KEEP = 20
"""Candidates ranked exactly by default: the table's top and the compile stage draw from these."""


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
    memory = MemoryModel(shape, work)
    fitting, rejections, meshes, evaluations = enumerate_fitting(cfg, shape, work, target, memory)
    ranked, slower, timed = rank(shape, work, target, memory, fitting, keep, rejections, cfg)
    candidates = len(ranked) + slower + sum(r.count for r in rejections)
    return SearchResult(cfg=cfg, target=target, shape=shape, workload=work, ranked=tuple(ranked),
                        rejections=tuple(rejections), slower=slower, meshes=meshes, candidates=candidates,
                        evaluations=evaluations + timed, seconds=time.perf_counter() - start)


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
    return min((estimate_with(shape, dataclasses.replace(c, dcn=d), work, target.hardware, mem, terms)
                for d in placements), key=lambda e: (e.timing.step, e.candidate.dcn))

"""The planner's estimate of one candidate: memory, collectives and step time together (`estimate`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any

from spmd_train.analysis.plan.candidate import Candidate, Workload
from spmd_train.analysis.plan.comm import CommTerm, comm_terms
from spmd_train.analysis.plan.memory import MemoryEstimate, estimate_memory
from spmd_train.analysis.plan.shape import ModelShape
from spmd_train.analysis.plan.timing import LINK_EFFICIENCY, Timing, estimate_timing
from spmd_train.hardware import Hardware
from spmd_train.units import human_bytes


@dataclass(frozen=True)
class Estimate:
    """What the analytic model says of one candidate on one kind of hardware."""

    candidate: Candidate
    memory: MemoryEstimate
    comm: tuple[CommTerm, ...]
    timing: Timing
    fits: bool
    """Whether the estimated peak fits the device's HBM."""


def estimate(shape: ModelShape, candidate: Candidate, hw: Hardware, *, global_batch: int, seq_len: int,
             workload: Workload | None = None, achievable: float | None = None,
             efficiency: float = LINK_EFFICIENCY) -> Estimate:
    """Memory, collective bytes and step time of `candidate` training `shape` on `hw`, with `workload`'s optimizer,
    attention and MoE settings (default: AdamW, a flash kernel, capacity MoE) at this batch and length."""
    w = (Workload(global_batch=global_batch, seq_len=seq_len) if workload is None
         else replace(workload, global_batch=global_batch, seq_len=seq_len))
    memory = estimate_memory(shape, candidate, w)
    terms = comm_terms(shape, candidate, w)
    timing = estimate_timing(shape, candidate, w, hw, terms, achievable=achievable, efficiency=efficiency)
    return Estimate(candidate=candidate, memory=memory, comm=tuple(terms), timing=timing,
                    fits=memory.peak <= hw.hbm_bytes)


MEMORY_PARTS = tuple(f.name for f in dataclasses.fields(MemoryEstimate))
"""The parts of a memory estimate, in the order `plan --explain` and `describe` list them."""


def memory_parts(memory: MemoryEstimate) -> dict[str, float]:
    """Every part of a memory estimate, then its model state and peak."""
    return {**dataclasses.asdict(memory), "state": memory.state, "peak": memory.peak}


def comm_json(term: CommTerm) -> dict[str, Any]:
    """One collective term as JSON: op, axes, bytes, count, purpose."""
    return dataclasses.asdict(term)


def analysis_lines(memory: MemoryEstimate, terms: list[CommTerm] | tuple[CommTerm, ...]) -> list[str]:
    """The memory parts and the collectives of an estimate, one line each, as `plan --explain` and `describe` print
    them."""
    lines = [f"  {f:18s} {human_bytes(getattr(memory, f)):>12s}" for f in MEMORY_PARTS]
    lines.append("collectives per step (bytes each device sends):")
    for term in terms:
        lines.append(f"  {term.op:18s} over {' x '.join(term.axes):24s} {human_bytes(term.bytes):>12s} in "
                     f"{term.count:,.0f} launches ({term.purpose})")
    return lines

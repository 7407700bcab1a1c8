"""The planner's estimate of one candidate: memory, collectives and step time together (`estimate`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from spmd_train.analysis.plan.candidate import Candidate, Workload
from spmd_train.analysis.plan.comm import CommTerm, comm_terms
from spmd_train.analysis.plan.memory import MemoryEstimate, estimate_memory
from spmd_train.analysis.plan.shape import ModelShape
from spmd_train.analysis.plan.timing import LINK_EFFICIENCY, Timing, estimate_timing
from spmd_train.hardware import Hardware


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

"""Step time of a candidate: compute at an achievable fraction of peak, each collective by the α-β model, the
pipeline bubble, and an overlap rule; then tokens/s, MFU and each axis's communication-to-computation ratio.

Derivation: docs/explanation/planner-model.md#step-time
"""

from __future__ import annotations

from dataclasses import dataclass

from spmd_train.analysis.plan.candidate import (
    Candidate,
    Workload,
    capacity_slots,
    microbatches,
    rows_per_device,
    schedule_stats,
)
from spmd_train.analysis.plan.comm import CommTerm, optimizer_flops
from spmd_train.analysis.plan.memory import estimate_memory
from spmd_train.analysis.plan.shape import ModelShape
from spmd_train.analysis.plan.stages import stage_imbalance
from spmd_train.config.mesh_schema import RECOMPUTES_LAYER, offloads_activations
from spmd_train.config.precision_schema import quantizes_experts
from spmd_train.hardware import Hardware

ACHIEVABLE_FRACTION = 0.6
"""Fraction of the dense peak a large transformer's matmuls sustain: MFUs of 0.4-0.6 are what well-tuned JAX
and Megatron runs report, so 0.6 for compute alone (communication and the bubble are counted apart)."""
LINK_EFFICIENCY = 0.9
"""Fraction of a link's nominal bandwidth a collective reaches: the scaling-book plans ICI at 9e10 of a 1e11 link
(https://jax-ml.github.io/scaling-book/tpus/); applied to every link until `bench-collectives` measures it."""
OVERLAPPED = frozenset({"weights", "grad-scatter"})
"""CommTerm purposes that hide behind compute (ring context-parallel permutes too)."""


@dataclass(frozen=True)
class AxisTime:
    """Communication time over one set of mesh axes, and how it compares with the compute."""

    axes: tuple[str, ...]
    seconds: float
    exposed: float
    """The part on the critical path (after the overlap rule; hidden seconds are shared pro rata)."""
    ratio: float
    """Communication seconds / compute seconds."""
    regime: str
    """"communication-bound" when the ratio exceeds 1, else "compute-bound"."""


@dataclass(frozen=True)
class Timing:
    """Step time and what it is made of, per device."""

    model_flops: float
    """Model FLOPs of the whole step (all devices), by the `models.flops` convention."""
    device_flops: float
    """FLOPs the busiest device runs: model FLOPs per device plus recompute, empty capacity slots, imbalance."""
    compute: float
    """Seconds of compute, bubble excluded."""
    bubble: float
    """Pipeline bubble fraction (0 without stages)."""
    communication: float
    """Seconds of communication, all of it."""
    exposed: float
    """Seconds of communication left on the critical path."""
    step: float
    tokens_per_second: float
    mfu: float
    axes: tuple[AxisTime, ...]
    host_transfer: float = 0.0
    """Seconds of host-link transfers on the critical path (`host_transfer_seconds`): offload.optimizer's state in and
    out, and offloaded layer inputs where they outlast the compute."""


TIE = 1e-4
"""Step times within this fraction of each other tie (differences below it are float noise and latencies)."""


def ties(a: Timing, b: Timing) -> bool:
    """Whether two step times tie (`TIE`)."""
    return abs(a.step - b.step) <= TIE * min(a.step, b.step)


def ring_allreduce_seconds(p: int, n: float, alpha: float, beta: float) -> float:
    """Ring all-reduce of n bytes over p devices: 2(p-1)·α + 2(p-1)/p·n·β (Patarasuk & Yuan 2009)."""
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta


def collective_seconds(term: CommTerm, c: Candidate, hw: Hardware, efficiency: float = LINK_EFFICIENCY) -> float:
    """α-β time of one `CommTerm` over its axes, hierarchically where part of the group is on the slow link;
    `efficiency` applies to links whose own `Link.efficiency` is unset (nominal, not measured)."""
    fast_n, slow_n = c.split(term.axes)
    n = fast_n * slow_n
    fast_bw, slow_bw = (link.bandwidth * (efficiency if link.efficiency is None else link.efficiency)
                        for link in (hw.fast, hw.slow))
    if term.op == "collective-permute":
        link, bw = (hw.slow, slow_bw) if slow_n > 1 else (hw.fast, fast_bw)
        return term.count * link.latency + term.bytes / bw
    if term.op == "all-to-all":
        slow_share = (n - fast_n) / (n - 1)
        hops = (fast_n - 1) * hw.fast.latency + (n - fast_n) * hw.slow.latency
    else:
        slow_share = (slow_n - 1) / (n - 1)
        rounds = 2 if term.op == "all-reduce" else 1
        hops = rounds * ((fast_n - 1) * hw.fast.latency + (slow_n - 1) * hw.slow.latency)
    return term.count * hops + term.bytes * (slow_share / slow_bw + (1 - slow_share) / fast_bw)


def achievable_fraction(hw: Hardware, given: float | None = None) -> float:
    """The fraction of peak compute runs at: `given`, else the one measured for `hw`, else `ACHIEVABLE_FRACTION`."""
    if given is not None:
        return given
    return ACHIEVABLE_FRACTION if hw.achievable is None else hw.achievable


def quantized_share(m: ModelShape, w: Workload) -> float:
    """The share of a token's FLOPs in quantized matmuls under w.matmul: 6 per `ModelShape.quantized_params`, and
    per routed-expert parameter a token uses where the experts' matmuls are quantized too (`quantizes_experts`)."""
    params = m.quantized_params() + (m.routed_expert_params if quantizes_experts(w.matmul, w.moe_impl) else 0)
    return min(1.0, 6.0 * params / m.flops_per_token(w.seq_len))


def compute_seconds(m: ModelShape, w: Workload, hw: Hardware, flops: float, achievable: float | None = None) -> float:
    """Seconds a device computes `flops` of the step: the share in quantized matmuls (precision.matmul=fp8|int8:
    `quantized_share`, recomputation included in proportion) at the chip's FP8 or int8 peak
    (`Hardware.matmul_peak`), the rest at its bf16 peak, both at the achievable fraction."""
    rate = hw.peak_flops * achievable_fraction(hw, achievable)
    if w.matmul == "default":
        return flops / rate
    share = quantized_share(m, w)
    return flops * (1 - share + share * hw.peak_flops / hw.matmul_peak(w.matmul)) / rate


def device_flops(m: ModelShape, c: Candidate, w: Workload) -> tuple[float, float]:
    """(model FLOPs of the step over all devices, FLOPs the busiest device runs)."""
    tokens = w.global_batch * w.seq_len
    model = m.flops_per_token(w.seq_len) * tokens
    attention_fwd = m.attention_flops_per_token(w.seq_len) / 3  # one forward pass of attention, per token
    experts_fwd = 2 * m.routed_expert_params  # routed experts, forward
    head = m.d_model * m.vocab_size
    extra = 0.0  # per token
    if c.remat in RECOMPUTES_LAYER:
        extra = 2 * (m.matmul_params - head) + attention_fwd
    elif c.remat == "save_matmuls_no_batch":
        extra = attention_fwd + experts_fwd
    elif c.remat == "save_matmuls" and w.attention == "flash":
        extra = attention_fwd
    if m.moe_layers and w.moe_impl in ("capacity", "capacity_dedup"):
        rows = rows_per_device(c, w) / microbatches(c, rows_per_device(c, w))
        group = rows * w.seq_len / c.sequence
        filled = m.num_experts * capacity_slots(m, w, group) / (m.experts_per_token * group)
        extra += 3 * experts_fwd * (filled - 1)  # forward and backward of the empty slots
    if c.sequence > 1 and c.context_parallel == "allgather":
        extra += 3 * attention_fwd * (c.sequence - 1) / c.sequence  # the last device's (2N-1)/N share
    # A pipeline's step waits for its busiest stage: the LM head's, or the deepest chunk's under uneven stages.
    busiest = (model + extra * tokens) / c.devices * stage_imbalance(m, c, w.seq_len)
    return model, busiest + optimizer_flops(m, c, w)


def estimate_timing(m: ModelShape, c: Candidate, w: Workload, hw: Hardware, terms: list[CommTerm], *,
                    achievable: float | None = None, efficiency: float = LINK_EFFICIENCY) -> Timing:
    """Step time, tokens/s, MFU and per-axis communication of candidate `c` on `hw`, given its collectives
    (`achievable` None: the measured `hw.achievable`, else `ACHIEVABLE_FRACTION`)."""
    model, busiest = device_flops(m, c, w)
    compute = compute_seconds(m, w, hw, busiest, achievable)
    bubble = 0.0
    if c.pipeline > 1:
        _, bubble, _ = schedule_stats(c.pipeline_schedule, c.pipeline, microbatches(c, rows_per_device(c, w)),
                                      c.virtual_stages)
    times = [collective_seconds(t, c, hw, efficiency) for t in terms]
    hideable = 0.0 if hw.simulated else sum(s for t, s in zip(terms, times, strict=True) if _overlaps(t, c))
    hidden = min(hideable, compute)
    total = sum(times)
    exposed = total - hidden
    host = host_transfer_seconds(m, c, w, hw, compute)
    step = (compute if hw.simulated else compute / (1 - bubble)) + exposed + host
    hidden_share = hidden / hideable if hideable else 0.0
    per_axes: dict[tuple[str, ...], list[float]] = {}
    for t, s in zip(terms, times, strict=True):
        entry = per_axes.setdefault(t.axes, [0.0, 0.0])
        entry[0] += s
        entry[1] += s * (1 - hidden_share) if _overlaps(t, c) else s
    axes = tuple(AxisTime(a, s, e, s / compute, "communication-bound" if s > compute else "compute-bound")
                 for a, (s, e) in per_axes.items())
    return Timing(model_flops=model, device_flops=busiest, compute=compute, bubble=bubble, communication=total,
                  exposed=exposed, step=step, tokens_per_second=w.global_batch * w.seq_len / step,
                  mfu=model / (step * hw.peak_flops * c.devices), axes=axes, host_transfer=host)


def host_transfer_seconds(m: ModelShape, c: Candidate, w: Workload, hw: Hardware, compute: float) -> float:
    """Seconds of the step's host-link transfers on its critical path, at the device kind's `DeviceSpec.host_link`
    each way (none where no source gives it): the offloaded optimizer state in and out after the backward pass (and
    under offload.params the parameters with it, and their gradients read twice: norm, update), and beside the
    compute, hidden
    behind the `compute` seconds they overlap: the layers' inputs out and back under parallel.remat=
    offload_layer_inputs, the offloaded parameters fetched twice a microbatch and their gradients sent out."""
    link = hw.spec.host_link
    if link is None or not (c.offload or w.offload_params or offloads_activations(c.remat, w.remat_offload)):
        return 0.0
    memory = estimate_memory(m, c, w)  # what is on the host: the memory model's figures
    params, grads = memory.host_params, memory.host_grads
    # Beside the compute: the inputs out and back, each microbatch's layers fetched for the forward pass and again
    # for the backward's recompute, and their gradients out. After it, toward the device: the gradients read for
    # their norm and again for the update, the parameters and the state (out at the same time: the new values).
    beside = 2 * memory.host_activations * c.grad_accum + (2 * params + grads) * c.grad_accum
    return (memory.host_optimizer + params + 2 * grads) / link + (max(0.0, beside / link - compute) if beside else 0.0)


def _overlaps(t: CommTerm, c: Candidate) -> bool:
    return t.purpose in OVERLAPPED or (t.purpose == "context" and c.context_parallel == "ring")

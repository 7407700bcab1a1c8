"""What `spmd-train plan` says about a search: where the time goes, why the runner-up lost, what was refused and
why nothing could be found, as text and as JSON. Pure Python (no jax)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from spmd_train.analysis.plan.candidate import Candidate, Workload
from spmd_train.analysis.plan.compiled import Compiled
from spmd_train.analysis.plan.enumeration import MICROBATCHES, PIPELINES
from spmd_train.analysis.plan.labels import label
from spmd_train.analysis.plan.model import Estimate, comm_json, memory_parts
from spmd_train.analysis.plan.ranking import Ranked
from spmd_train.analysis.plan.rejections import Rejection, factorizations, mesh_reason, structure_reason
from spmd_train.analysis.plan.search import SearchResult
from spmd_train.analysis.plan.shape import ModelShape
from spmd_train.analysis.plan.target import Target, target_for
from spmd_train.analysis.plan.timing import Timing, quantized_share, ties
from spmd_train.config.mesh_schema import MESH_AXES
from spmd_train.config.schema import Config
from spmd_train.errors import ConfigError
from spmd_train.hardware import Hardware
from spmd_train.units import GiB


def seconds(t: float) -> str:
    """A duration for people: 1.438 s, 12.40 ms, 310.2 us."""
    if t >= 1:
        return f"{t:.3f} s"
    return f"{t * 1e3:.2f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} us"


def count(n: float) -> str:
    """A parameter count for people: 8.03B, 124.44M, 106,816."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def time_parts(t: Timing, devices: int) -> dict[str, float]:
    """The step time as a sum: model compute, recompute and imbalance, the pipeline bubble, exposed communication."""
    useful = t.compute * t.model_flops / devices / t.device_flops if t.device_flops else t.compute
    parts = {"compute": useful, "recompute and imbalance": t.compute - useful,
             "pipeline bubble": t.compute / (1 - t.bubble) - t.compute}
    for a in t.axes:
        parts[f"exposed {' x '.join(a.axes)} communication"] = a.exposed
    if t.host_transfer:
        parts["optimizer state over the host link"] = t.host_transfer
    return parts


def quantized_compute_line(m: ModelShape, w: Workload, hw: Hardware) -> str:
    """Which FLOPs `compute` times at the chip's FP8 or int8 peak (precision.matmul), and that peak."""
    share = quantized_share(m, w)
    peak, bf16 = hw.matmul_peak(w.matmul), hw.peak_flops
    rate = (f"at its {w.matmul} peak, {peak / 1e12:,.0f} TFLOP/s against bf16's {bf16 / 1e12:,.0f}" if peak != bf16
            else f"at the bf16 rate (no faster {w.matmul} matmul on {hw.kind} in the hardware table)")
    return f"  (compute: the {w.matmul} matmuls, {share:.0%} of the FLOPs, {rate})"


def tie_reason(winner: Timing, runner: Timing) -> str:
    """Why the first of two tied layouts comes first (`search.tie_order`)."""
    if winner.communication < runner.communication:
        return (f"the winner ranks first because it communicates less ({seconds(winner.communication)} against "
                f"{seconds(runner.communication)} a step, hidden or not): more slack if the overlap falls short")
    return "labels order them"


def why_lost(winner: Timing, runner: Timing, runner_label: str, devices: int) -> str:
    """One sentence: how much slower the runner-up is, and the part of the time most of the gap is in."""
    if ties(winner, runner):
        return (f"the runner-up, {runner_label}, ties with the winner ({seconds(winner.step)} a step); "
                f"{tie_reason(winner, runner)}")
    mine, theirs = time_parts(winner, devices), time_parts(runner, devices)
    gaps = {k: theirs.get(k, 0.0) - mine.get(k, 0.0) for k in {*mine, *theirs}}
    part = max(sorted(gaps), key=gaps.get)
    pct = 100 * (runner.step / winner.step - 1)
    share = f"{pct:.2f}%" if pct < 1 else f"{pct:.1f}%"
    return (f"the runner-up, {runner_label}, is {share} slower ({seconds(runner.step)} against "
            f"{seconds(winner.step)} a step), mostly in {part}: {seconds(theirs.get(part, 0.0))} against "
            f"{seconds(mine.get(part, 0.0))}")


def require_layouts(result: SearchResult, source: str | None = None) -> None:
    """ConfigError when the search found nothing to rank: no layout passes the checks, or none fits (`source`: the
    config file, which names a model without a preset)."""
    if result.ranked:
        return
    cfg, target = result.cfg, result.target
    closest = result.closest()
    name = cfg.model.preset or f"of {source or 'this config'}"
    what = f"model {name} ({count(result.shape.total_params)} parameters)"
    if closest is None:
        rules = "; ".join(f"{n} x {rule}" for rule, _, n, _ in result.counts()[:4])
        raise ConfigError(f"no layout of the {what} runs on {target.describe()}: every factorization of "
                          f"{target.devices} devices over the mesh axes is refused ({rules}) (valid device counts "
                          f"near it: {', '.join(map(str, workable_counts(cfg, target)))})")
    hbm = target.hardware.hbm_bytes
    need = math.ceil(target.devices * closest.peak / hbm)
    offload = (", optimizer-state offload (to host memory)" if result.workload.offloads_state else "")
    raise ConfigError(
        f"the {what} fits nowhere on {target.describe()} ({hbm / GiB:.1f} GiB per device): the closest layout, "
        f"{closest.label}, needs {closest.peak / GiB:.1f} GiB per device ({closest.detail}); every ZeRO stage "
        f"(ZeRO-3 shards the whole state), remat policy (full keeps one input per layer){offload} and grad "
        f"accumulation was tried, so it needs more devices (about {need} for that layout's memory to fit) or a smaller "
        "train.global_batch_size, train.seq_len or model")


def workable_counts(cfg: Config, target: Target, limit: int = 8) -> list[int]:
    """Device counts near the target's with at least one layout that passes the divisibility checks."""
    n = target.devices
    tried = sorted({*range(1, min(2 * n, 64) + 1), *(2**k for k in range(int(math.log2(4 * n)) + 1))})
    shape = ModelShape.from_config(cfg.model)
    found = []
    for devices in tried:
        try:
            there = target_for(devices, target.hardware.kind, None) if target.topology is None else \
                dataclasses.replace(target, devices=devices, domains=1)
        except ConfigError:
            continue
        if devices != n and _any_layout(cfg, shape, there):
            found.append(devices)
    return sorted(found, key=lambda c: (abs(c - n), c))[:limit]


def _any_layout(cfg: Config, shape: ModelShape, target: Target) -> bool:
    for sizes in factorizations(target.devices):
        mesh = Candidate(*sizes)
        if mesh_reason(cfg, shape, mesh, target) is None:
            micro = [(s, v, k * mesh.pipeline) for s, v in PIPELINES for k in MICROBATCHES] \
                if mesh.pipeline > 1 else [("1f1b", 1, None)]
            for schedule, virtual, m in micro:
                c = dataclasses.replace(mesh, pipeline_schedule=schedule, virtual_stages=virtual,
                                        pipeline_microbatches=m)
                if structure_reason(cfg, shape, c) is None:
                    return True
    return False


# --- JSON ----------------------------------------------------------------------------------------------------------


def estimate_json(est: Estimate) -> dict[str, Any]:
    """One estimate: the layout, memory parts and peak, every collective, the time and its parts."""
    c = est.candidate
    layout = {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
    layout["dcn"] = dict(zip(MESH_AXES, c.dcn, strict=True))
    if c.rules is None:  # the default preset, which every candidate of a search has
        del layout["rules"]
    timing = dataclasses.asdict(est.timing)
    return {"label": label(c), "layout": layout,
            "memory": memory_parts(est.memory), "comm": [comm_json(t) for t in est.comm], "timing": timing,
            "time_parts": time_parts(est.timing, c.devices), "fits": est.fits}


def compiled_json(comp: Compiled, devices: int) -> dict[str, Any]:
    """One compiled candidate: its compiled figures against the estimate of the same program, and the re-estimate."""
    return {"platform": comp.platform, "compile_seconds": comp.seconds, "peak_bytes_compiled": comp.peak_compiled,
            "peak_bytes_estimated": comp.reference.memory.peak, "memory_error": comp.memory_error,
            "bytes_per_axes": [{"axes": list(a), "estimated": e, "compiled": c}
                               for a, (e, c) in comp.bytes_error().items()],
            "peak_bytes": comp.peak, "fits": comp.fits, "timing": dataclasses.asdict(comp.timing),
            "time_parts": time_parts(comp.timing, devices), "notes": list(comp.notes)}


def rejection_json(r: Rejection) -> dict[str, Any]:
    """One rejection: its label at the scope it was decided, the rule, this case, what kind, how many it covers."""
    return {"label": r.label, "rule": r.rule, "detail": r.detail, "kind": r.kind, "count": r.count,
            "scope": r.scope.name.lower()}


def row_json(rank: int, ranked: Ranked, compiled: Compiled | None) -> dict[str, Any]:
    """A row of the ranking: the estimate, and the compiled figures where there are some."""
    return {"rank": rank, **estimate_json(ranked.estimate),
            "compiled": compiled_json(compiled, ranked.estimate.candidate.devices) if compiled else None}

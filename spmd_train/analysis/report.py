"""`describe`: compile one train step on abstract inputs and report what it costs per device."""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

import jax
from jax.sharding import NamedSharding

from spmd_train.analysis.collectives import CollectiveSummary, collectives_of
from spmd_train.analysis.context_report import compiled_over_sequence, context_section
from spmd_train.analysis.hlo import matmul_flops
from spmd_train.analysis.moe_report import moe_section
from spmd_train.analysis.render import PIPELINE_FLOPS_NOTE, Rendered
from spmd_train.analysis.stage_costs import stage_shares
from spmd_train.analysis.topology import tpu_topology_devices, without_persistent_cache
from spmd_train.analysis.zero_floor import FloorTerm, floor_by_axes, zero_floor
from spmd_train.config.schema import Config
from spmd_train.devices import simulate_devices
from spmd_train.errors import ConfigError
from spmd_train.hardware import device_spec
from spmd_train.models.flops import balanced_depths, flops_per_token
from spmd_train.parallel.schedules import simulate
from spmd_train.sharding.arithmetic import rows_per_device, spec_axes, ways
from spmd_train.train.engine import Engine
from spmd_train.train.pipelined import chunk_depths, saved_bytes_per_microbatch, stash_bytes_per_microbatch


@dataclass(frozen=True)
class ParamRow:
    """One parameter: where it lives and what it costs each device."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    logical: tuple[str | None, ...]
    spec: tuple[Any, ...]
    bytes_per_device: int


@dataclass(frozen=True)
class PipelineStage:
    """One pipeline stage under the schedule: its work and the VJP residuals it holds at most."""

    stage: int
    busy_ticks: int
    """Ticks this stage runs a forward or a backward (the rest of the step's ticks it idles)."""
    peak_in_flight: int
    """Most (microbatch, chunk) pairs whose forward has run and whose backward has not, at once."""
    stash_bytes: int
    """peak_in_flight x the stash of one (microbatch, chunk): the residuals this stage needs at most."""
    flops: float = 0.0
    """Model FLOPs this stage's devices each run per step: their layers' (`analysis.stage_costs`), the LM head on the
    stage of the last chunk; the mean over stages is the step's model FLOPs per device."""


@dataclass(frozen=True)
class PipelineReport:
    """The pipeline schedule of a step (mesh.pipeline > 1) and the activation memory it implies."""

    schedule: str
    stages: int
    microbatches: int
    """Microbatches per pipeline flush; one optimizer step runs train.grad_accum flushes."""
    virtual_stages: int
    microbatch_rows: int
    """Rows of one microbatch on one device (of the batch axes data x fsdp x expert)."""
    ticks: int
    bubble_fraction: float
    """Idle (stage, tick) slots / (stages x ticks), from simulating the schedule table."""
    bubble_fraction_formula: float
    """The closed form (p - 1) / (v m + p - 1) the schedules reach."""
    stash_bytes_per_microbatch: int
    """Bytes one (microbatch, chunk) forward keeps for its backward on one device (weights excluded;
    an upper bound when activations are split over `tensor`)."""
    stash_slots: int
    """Stash slots the compiled program reserves on every device: the SPMD program is the same on
    every stage, so it is sized for the stage that needs the most."""
    activation_slots: int
    cotangent_slots: int
    per_stage: list[PipelineStage]
    compiled_flops_all_branches: float | None
    """The loop-aware matmul FLOP count of the compiled program, which counts both the forward and
    the backward branch of the per-tick `lax.switch` on every tick (an over-count; see notes)."""
    saved_bytes_per_microbatch: int = 0
    """Split-backward schedules (zb_h1, zb_v): bytes B hands to W for one (microbatch, chunk) on one device (the
    per-matmul output cotangents W needs; an upper bound like the stash's); 0 for the fused schedules."""
    saved_slots: int = 0
    """Slots for those, reserved on every device (0 for the fused schedules)."""
    chunk_layers: tuple[int, ...] = ()
    """Layers in each model chunk, in model order (equal: the executor's stages hold equal stacks)."""
    balanced_layers: tuple[int, ...] = ()
    """The contiguous split of the layers into chunks (whole MoE groups) whose costliest chunk, LM head included,
    costs least (`analysis.stage_costs.balanced_depths`); equal to chunk_layers when no split is more even."""
    balanced_flops: tuple[float, ...] = ()
    """Per-stage FLOPs per device per step under balanced_layers."""

    @property
    def stash_bytes_reserved(self) -> int:
        """stash_slots x stash_bytes_per_microbatch: the stash buffers' size on every device."""
        return self.stash_slots * self.stash_bytes_per_microbatch

    @property
    def saved_bytes_reserved(self) -> int:
        """saved_slots x saved_bytes_per_microbatch: what B keeps for W, on every device."""
        return self.saved_slots * self.saved_bytes_per_microbatch

    def to_json(self) -> dict[str, Any]:
        """The `pipeline` section of `StepReport.to_json()`."""
        return {
            "schedule": self.schedule,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "virtual_stages": self.virtual_stages,
            "microbatch_rows": self.microbatch_rows,
            "ticks": self.ticks,
            "bubble_fraction": self.bubble_fraction,
            "bubble_fraction_formula": self.bubble_fraction_formula,
            "stash_bytes_per_microbatch": self.stash_bytes_per_microbatch,
            "stash_slots": self.stash_slots,
            "stash_bytes_reserved": self.stash_bytes_reserved,
            "saved_bytes_per_microbatch": self.saved_bytes_per_microbatch,
            "saved_slots": self.saved_slots,
            "saved_bytes_reserved": self.saved_bytes_reserved,
            "activation_slots": self.activation_slots,
            "cotangent_slots": self.cotangent_slots,
            "per_stage": [{"stage": s.stage, "busy_ticks": s.busy_ticks, "peak_in_flight": s.peak_in_flight,
                           "stash_bytes": s.stash_bytes, "flops": s.flops} for s in self.per_stage],
            "chunk_layers": list(self.chunk_layers),
            "balanced_layers": list(self.balanced_layers),
            "balanced_flops": list(self.balanced_flops),
            "compiled_flops_all_branches": self.compiled_flops_all_branches,
        }


@dataclass(frozen=True)
class StepReport(Rendered):
    """Everything `spmd-train describe` shows, for one config on one mesh."""

    mesh: dict[str, int]
    devices: int
    device_kind: str
    topology: str | None
    param_count: int
    params: list[ParamRow]
    per_device: dict[str, float | None]
    """Bytes and FLOPs per device; the compiled figures are None when the program does not fit. `flops` is
    the compiled program's loop-aware matmul count, except for pipelined steps, where it is `model_flops`
    (see PipelineReport.compiled_flops_all_branches)."""
    collectives: list[CollectiveSummary]
    hbm_bytes: float | None
    fits: bool | None
    compile_seconds: float
    notes: list[str] = field(default_factory=list)
    pipeline: PipelineReport | None = None
    """The schedule and its activation memory, when mesh.pipeline > 1 (else None)."""
    moe: dict[str, Any] | None = None
    """Expert placement, capacity and expected all-to-all traffic, with MoE layers (else None)."""
    resolved: dict[str, Any] = field(default_factory=dict)
    """The effective sharding rules and the backends the engine chose (`Engine.resolved`)."""
    zero_floor: list[FloorTerm] = field(default_factory=list)
    """The least parameter traffic data parallelism and ZeRO need per device per step (`analysis.zero_floor`)."""
    context: dict[str, Any] | None = None
    """Context-parallel attention and its `sequence` traffic, predicted and compiled, with mesh.sequence > 1."""

    def floor_ratios(self) -> list[dict[str, Any]]:
        """Per mesh axes with a floor: compiled bytes over them (every collective), the floor bytes, the ratio.

        Where the floor or the parameter traffic spans more than one set of axes (data x fsdp, fsdp x
        expert) a last row, `total` true, compares the whole floor with every collective over its axes
        but the MoE token all-to-alls: the compiler may reduce over the axes together (a reduce-scatter
        over fsdp x expert, then a gather of the shard over expert, instead of a reduce-scatter over fsdp
        and an all-reduce over expert), which only the total compares.
        """
        done = self.per_device.get("flops") is not None  # False: did not compile
        compiled: dict[tuple[str, ...], float] = defaultdict(float)
        for c in self.collectives:
            if not self._attention_traffic(c):
                compiled[c.axes] += c.bytes
        floor = floor_by_axes(self.zero_floor)
        rows = [_ratio_row(list(axes), b, compiled[axes] if done else None) for axes, b in floor.items()]
        params = self.parameter_traffic()
        if len({c.axes for c in params} | set(floor)) > 1:
            total = sum(c.bytes for c in params) if done else None
            union = {a for axes in floor for a in axes}
            axes = [a for a in self.mesh if a in union]
            rows.append({**_ratio_row(axes, sum(floor.values()), total), "total": True})
        return rows

    def parameter_traffic(self) -> list[CollectiveSummary]:
        """The collectives the floor is compared with: all over its axes but the MoE token all-to-alls."""
        union = {a for t in self.zero_floor for a in t.axes}
        tokens = set(self.resolved.get("rules", {}).get("activations", {}).get("experts", ())) if self.moe else set()
        return [c for c in self.collectives
                if set(c.axes) <= union and not (c.op == "all-to-all" and set(c.axes) <= tokens)
                and not self._attention_traffic(c)]

    def _attention_traffic(self, c: CollectiveSummary) -> bool:
        """Whether a collective is context-parallel attention's (its ops over `sequence` alone), not parameters'."""
        return self.context is not None and tuple(c.axes) == ("sequence",) and c.op in self.context["collectives"]

    def to_json(self) -> dict[str, Any]:
        """The public JSON form (keys mesh, devices, param_count, per_device, collectives, pipeline, ...)."""
        return {
            "mesh": self.mesh,
            "devices": self.devices,
            "device_kind": self.device_kind,
            "topology": self.topology,
            "param_count": self.param_count,
            "per_device": self.per_device,
            "collectives": [c.to_json() for c in self.collectives],
            "hbm_bytes": self.hbm_bytes,
            "fits": self.fits,
            "compile_seconds": self.compile_seconds,
            "params": [
                {"path": p.path, "shape": list(p.shape), "dtype": p.dtype, "logical": list(p.logical),
                 "spec": [list(e) if isinstance(e, tuple) else e for e in p.spec],
                 "bytes_per_device": p.bytes_per_device}
                for p in self.params
            ],
            "notes": self.notes,
            "pipeline": self.pipeline.to_json() if self.pipeline else None,
            "moe": self.moe,
            "context": self.context,
            "resolved": self.resolved,
            "zero_floor": {"terms": [t.to_json() for t in self.zero_floor], "by_axes": self.floor_ratios(),
                           "traffic": [c.to_json() for c in self.parameter_traffic()]},
        }


def describe(cfg: Config, *, topology: str | None = None, devices: list[jax.Device] | None = None) -> StepReport:
    """Lower and compile one train step for `cfg` (nothing is allocated or run) and account for it."""
    if topology is not None:
        devices = tpu_topology_devices(topology)
    elif devices is None:
        simulate_devices(cfg.run.simulate_devices)  # called from a notebook before jax started
    try:
        engine = Engine.build(cfg, devices)
    except ConfigError as err:
        if topology is None:
            raise
        raise ConfigError(f"{err} (on TPU slice {topology} with {len(devices)} devices)") from None
    state = engine.abstract_state()
    t = cfg.train
    batch = engine.abstract_batch()
    batch_bytes = sum(math.prod(a.shape) * 4 for a in jax.tree.leaves(batch)) / _ways(engine.batch_sharding)
    pipeline = _pipeline_report(engine) if engine.plan is not None else None
    moe = moe_section(engine)
    context = context_section(engine)
    floor = zero_floor(engine)
    start = time.perf_counter()
    lowered = engine.train_step.lower(state, batch)
    mesh = engine.mesh
    rows = _param_rows(engine, state.params)
    opt_bytes = _bytes_per_device(state.opt_state)
    model_flops = flops_per_token(cfg.model, t.seq_len) * t.global_batch_size * t.seq_len / mesh.size
    device = mesh.devices.flat[0]
    spec = device_spec(device.device_kind)
    try:
        # Devices of a slice we do not have come from a compile-only client (see without_persistent_cache).
        with contextlib.nullcontext() if device in jax.devices() else without_persistent_cache():
            compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as err:
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        # The TPU compiler refuses programs that cannot fit; that is an answer, not a failure.
        return StepReport(
            mesh=dict(mesh.shape), devices=mesh.size, device_kind=device.device_kind, topology=topology,
            param_count=engine.num_params, params=rows,
            per_device={"param_bytes": sum(r.bytes_per_device for r in rows), "opt_state_bytes": opt_bytes,
                        "batch_bytes": batch_bytes,
                        "argument_bytes": None, "output_bytes": None, "temp_bytes": None, "alias_bytes": None,
                        "peak_bytes": None, "flops": None, "model_flops": model_flops, "xla_cost_flops": None},
            collectives=[], hbm_bytes=spec.hbm_bytes if spec else None, fits=False,
            compile_seconds=time.perf_counter() - start,
            notes=["does not fit: " + str(err).split("RESOURCE_EXHAUSTED:", 1)[-1].strip().splitlines()[0]],
            pipeline=pipeline,
            moe=moe,
            resolved=engine.resolved(),
            zero_floor=floor,
            context=context,
        )
    compile_seconds = time.perf_counter() - start
    hlo = compiled.as_text()
    mem = compiled.memory_analysis()
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    per_device = {
        "param_bytes": sum(r.bytes_per_device for r in rows),
        "opt_state_bytes": opt_bytes,
        "batch_bytes": batch_bytes,
        "argument_bytes": mem.argument_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes,
        "temp_bytes": mem.temp_size_in_bytes,
        "alias_bytes": mem.alias_size_in_bytes,
        "peak_bytes": peak,
        "flops": matmul_flops(hlo),
        "model_flops": model_flops,
        "xla_cost_flops": float(cost.get("flops", float("nan"))) if cost else float("nan"),
    }
    collectives = collectives_of(hlo, mesh)
    if context is not None:
        context = {**context, "compiled": compiled_over_sequence(collectives, context["collectives"])}
    notes = []
    if device.platform == "cpu":
        notes.append("XLA:CPU lowers reduce-scatters it creates itself as all-reduce + slice; compile for a "
                     "TPU slice (--topology) to see the accelerator program")
    if pipeline is not None:
        # Each tick of the pipeline loop runs one branch of a `lax.switch` (idle, forward or
        # backward), but a static count of the program has to add up every branch on every tick.
        pipeline = replace(pipeline, compiled_flops_all_branches=per_device["flops"])
        per_device["flops"] = model_flops
        notes += [PIPELINE_FLOPS_NOTE, PIPELINE_COLLECTIVES_NOTE]
    return StepReport(
        mesh=dict(mesh.shape),
        devices=mesh.size,
        device_kind=device.device_kind,
        topology=topology,
        param_count=engine.num_params,
        params=rows,
        per_device=per_device,
        collectives=collectives,
        hbm_bytes=spec.hbm_bytes if spec else None,
        fits=(peak <= spec.hbm_bytes) if spec else None,
        compile_seconds=compile_seconds,
        notes=notes,
        pipeline=pipeline,
        moe=moe,
        resolved=engine.resolved(),
        zero_floor=floor,
        context=context,
    )


PIPELINE_COLLECTIVES_NOTE = (
    "pipelined step: collectives inside a stage's forward or backward (its fsdp/tensor gathers and reductions) "
    "are counted on every tick for each branch of the per-tick lax.switch, so their counts and bytes are upper "
    "bounds, by about ticks / (virtual stages x microbatches); the per-tick pipeline collective-permutes and the "
    "collectives outside the pipeline are exact"
)


def _pipeline_report(engine: Engine) -> PipelineReport:
    """The schedule's figures and the stash bytes they imply, from the plan the step was compiled with."""
    cfg, plan, sizes = engine.cfg, engine.plan, dict(engine.mesh.shape)
    sched, stats = plan.schedule, simulate(plan.schedule)
    p, m, v = sched.stages, sched.microbatches, sched.virtual
    rows = rows_per_device(cfg, sizes)
    per_mb = stash_bytes_per_microbatch(cfg, engine.block_graphdef, engine.param_shapes["blocks"], plan, rows)
    saved = (saved_bytes_per_microbatch(cfg, engine.block_graphdef, engine.param_shapes["blocks"], plan, rows)
             if sched.split_backward else 0)
    model, seq = cfg.model, cfg.train.seq_len
    per_device = flops_per_token(model, seq) * cfg.train.global_batch_size * seq / engine.mesh.size
    current = [rows * max(model.moe_every, 1) for rows in chunk_depths(cfg, p)]
    balanced = balanced_depths(model, seq, p * v)
    flops = lambda depths: [share * per_device * p for share in stage_shares(model, seq, depths, p, sched.placement)]
    return PipelineReport(
        schedule=sched.name, stages=p, microbatches=m, virtual_stages=v, microbatch_rows=rows // m,
        ticks=plan.num_ticks, bubble_fraction=stats.bubble_fraction,
        # Split schedules run 3 one-tick ops (F, B, W) per microbatch-chunk: ZB-H1's closed form, ZB-V's lower bound.
        bubble_fraction_formula=(p - 1) / ((3 if sched.split_backward else 1) * v * m + p - 1),
        stash_bytes_per_microbatch=per_mb, stash_slots=plan.stash_slots,
        activation_slots=plan.act_slots, cotangent_slots=plan.ct_slots,
        per_stage=[PipelineStage(stage=s, busy_ticks=stats.busy_ticks[s], peak_in_flight=stats.peak_in_flight[s],
                                 stash_bytes=stats.peak_in_flight[s] * per_mb, flops=f)
                   for s, f in zip(range(p), flops(current), strict=True)],
        compiled_flops_all_branches=None, saved_bytes_per_microbatch=saved, saved_slots=plan.saved_slots,
        chunk_layers=tuple(current), balanced_layers=tuple(balanced), balanced_flops=tuple(flops(balanced)),
    )


def _param_rows(engine: Engine, params: Any) -> list[ParamRow]:
    rows = []
    flat_logical = dict(jax.tree_util.tree_flatten_with_path(engine.logical, is_leaf=lambda x: isinstance(x, tuple))[0])
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        logical = flat_logical[path]
        rows.append(ParamRow(
            path=".".join(str(getattr(k, "key", k)) for k in path),
            shape=tuple(leaf.shape),
            dtype=str(leaf.dtype),
            logical=tuple(logical),
            spec=tuple(leaf.sharding.spec) + (None,) * (len(leaf.shape) - len(leaf.sharding.spec)),
            bytes_per_device=_shard_bytes(leaf),
        ))
    return rows


def _shard_bytes(leaf: jax.ShapeDtypeStruct) -> int:
    shape = leaf.sharding.shard_shape(leaf.shape) if isinstance(leaf.sharding, NamedSharding) else leaf.shape
    return math.prod(shape) * leaf.dtype.itemsize


def _bytes_per_device(tree: Any) -> int:
    return sum(_shard_bytes(x) for x in jax.tree.leaves(tree))


def _ways(sharding: NamedSharding) -> int:
    return ways(spec_axes(sharding.spec), sharding.mesh.shape)


def _ratio_row(axes: list[str], floor: float, compiled: float | None) -> dict[str, Any]:
    return {"axes": axes, "floor_bytes": floor, "compiled_bytes": compiled,
            "ratio": compiled / floor if compiled is not None and floor else None}

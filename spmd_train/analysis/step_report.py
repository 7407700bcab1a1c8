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

from spmd_train.analysis.analytic import analytic_layout, analytic_section
from spmd_train.analysis.collectives import CollectiveSummary, collectives_of
from spmd_train.analysis.context_report import compiled_over_sequence, context_section
from spmd_train.analysis.hlo import attention_kernel_flops, matmul_flops
from spmd_train.analysis.moe_report import moe_section
from spmd_train.analysis.param_rows import ParamRow, bytes_per_device, param_rows
from spmd_train.analysis.pipeline_report import PIPELINE_COLLECTIVES_NOTE, PipelineReport, pipeline_report
from spmd_train.analysis.render import PIPELINE_FLOPS_NOTE, Rendered
from spmd_train.analysis.topology import tpu_topology_devices, without_persistent_cache
from spmd_train.analysis.zero_floor import FloorTerm, floor_by_axes, zero_floor
from spmd_train.config.schema import Config
from spmd_train.devices import simulate_devices
from spmd_train.errors import ConfigError
from spmd_train.hardware import device_spec
from spmd_train.models.flops import flops_per_token
from spmd_train.sharding.arithmetic import spec_axes, ways
from spmd_train.train.engine import Engine


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
    analytic: dict[str, Any] | None = None
    """The analytic model's memory parts and collectives for this layout, what `plan --explain` prints for it
    (`analysis.analytic.analytic_section`)."""

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
            "analytic": self.analytic,
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
    pipeline = pipeline_report(engine) if engine.plan is not None else None
    layout = analytic_layout(engine)  # one hand-over for every analytic section
    moe = moe_section(engine, layout)
    context = context_section(engine, layout)
    floor = zero_floor(engine, layout)
    analytic = analytic_section(layout)
    start = time.perf_counter()
    lowered = engine.train_step.lower(state, batch)
    mesh = engine.mesh
    rows = param_rows(engine, state.params)
    opt_bytes = bytes_per_device(state.opt_state)
    model_flops = flops_per_token(cfg.model, t.seq_len) * t.global_batch_size * t.seq_len / mesh.size
    model_attention_flops = (flops_per_token(cfg.model, t.seq_len) - flops_per_token(cfg.model, 0)) * (
        t.global_batch_size * t.seq_len / mesh.size)
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
                        "peak_bytes": None, "flops": None, "model_flops": model_flops, "xla_cost_flops": None,
                        "attention_flops": None, "model_attention_flops": model_attention_flops},
            collectives=[], hbm_bytes=spec.hbm_bytes if spec else None, fits=False,
            compile_seconds=time.perf_counter() - start,
            notes=["does not fit: " + str(err).split("RESOURCE_EXHAUSTED:", 1)[-1].strip().splitlines()[0]],
            pipeline=pipeline,
            moe=moe,
            resolved=engine.resolved(),
            zero_floor=floor,
            context=context,
            analytic=analytic,
        )
    compile_seconds = time.perf_counter() - start
    hlo = compiled.as_text()
    mem = compiled.memory_analysis()
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    host_state = engine.offload.host_bytes_per_device if engine.offload else 0
    host_params = engine.offload.host_param_bytes_per_device if engine.offload else 0
    accum = cfg.train.grad_accum
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
        "attention_flops": attention_kernel_flops(hlo) or None,
        "model_attention_flops": model_attention_flops,
        "xla_cost_flops": float(cost.get("flops", float("nan"))) if cost else float("nan"),
        # offload.optimizer: the state's bytes in the host's memory (from shardings), and the compiled program's
        # own host figures (XLA:CPU reports none: its "host" and "device" are one memory).
        "host_state_bytes": host_state,
        "host_param_bytes": host_params,
        "host_argument_bytes": mem.host_argument_size_in_bytes,
        "host_temp_bytes": mem.host_temp_size_in_bytes,
        # The state in and out each step; offloaded parameters fetched twice a microbatch (forward, recompute), their
        # gradients (as many bytes at ZeRO-2 and 3) out each microbatch and read twice (norm, update), and the
        # parameters through the update in and out. The time is what waits on the link after the backward pass, in
        # its busier direction (toward the device: the state, the gradients twice, the parameters): the fetches
        # and gradients out run beside the compute.
        "host_transfer_bytes": 2 * host_state + (3 * accum + 4) * host_params,
        "host_transfer_seconds": ((host_state + 3 * host_params) / spec.host_link
                                  if (host_state or host_params) and spec and spec.host_link else None),
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
        per_device["flops"], per_device["attention_flops"] = model_flops, None
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
        analytic=analytic,
    )


def _ways(sharding: NamedSharding) -> int:
    return ways(spec_axes(sharding.spec), sharding.mesh.shape)


def _ratio_row(axes: list[str], floor: float, compiled: float | None) -> dict[str, Any]:
    return {"axes": axes, "floor_bytes": floor, "compiled_bytes": compiled,
            "ratio": compiled / floor if compiled is not None and floor else None}

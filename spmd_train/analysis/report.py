"""`describe`: compile one train step on abstract inputs and report what it costs per device."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import NamedSharding

from spmd_train.analysis.collectives import CollectiveSummary, collectives_of
from spmd_train.models.flops import flops_per_token
from spmd_train.analysis.hlo import matmul_flops
from spmd_train.analysis.topology import tpu_topology_devices
from spmd_train.config.schema import Config
from spmd_train.errors import ConfigError
from spmd_train.hardware import device_spec
from spmd_train.train.engine import Engine


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
class StepReport:
    """Everything `spmd-train describe` shows, for one config on one mesh."""

    mesh: dict[str, int]
    devices: int
    device_kind: str
    topology: str | None
    param_count: int
    params: list[ParamRow]
    per_device: dict[str, float | None]
    """Bytes and FLOPs per device; the compiled figures are None when the program does not fit."""
    collectives: list[CollectiveSummary]
    hbm_bytes: float | None
    fits: bool | None
    compile_seconds: float
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The public JSON form (keys mesh, devices, param_count, per_device, collectives, ...)."""
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
                 "spec": [list(e) if isinstance(e, tuple) else e for e in p.spec], "bytes_per_device": p.bytes_per_device}
                for p in self.params
            ],
            "notes": self.notes,
        }


def describe(cfg: Config, *, topology: str | None = None, devices: list[jax.Device] | None = None) -> StepReport:
    """Lower and compile one train step for `cfg` (nothing is allocated or run) and account for it."""
    if topology is not None:
        devices = tpu_topology_devices(topology)
    try:
        engine = Engine.build(cfg, devices)
    except ConfigError as err:
        if topology is None:
            raise
        raise ConfigError(f"{err} (on TPU slice {topology} with {len(devices)} devices)") from None
    state = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        jax.eval_shape(engine.init_fn),
        engine.state_shardings,
    )
    t = cfg.train
    tokens = jax.ShapeDtypeStruct((t.global_batch_size, t.seq_len + 1), "int32", sharding=engine.batch_sharding)
    start = time.perf_counter()
    lowered = engine.train_step.lower(state, tokens)
    mesh = engine.mesh
    rows = _param_rows(engine, state.params)
    opt_bytes = _bytes_per_device(state.opt_state)
    model_flops = flops_per_token(cfg.model, t.seq_len) * t.global_batch_size * t.seq_len / mesh.size
    device = mesh.devices.flat[0]
    spec = device_spec(device.device_kind)
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as err:
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        # The TPU compiler refuses programs that cannot fit; that is an answer, not a failure.
        return StepReport(
            mesh=dict(mesh.shape), devices=mesh.size, device_kind=device.device_kind, topology=topology,
            param_count=engine.num_params, params=rows,
            per_device={"param_bytes": sum(r.bytes_per_device for r in rows), "opt_state_bytes": opt_bytes,
                        "batch_bytes": math.prod(tokens.shape) * 4 / _ways(engine.batch_sharding),
                        "argument_bytes": None, "output_bytes": None, "temp_bytes": None, "alias_bytes": None,
                        "peak_bytes": None, "flops": None, "model_flops": model_flops, "xla_cost_flops": None},
            collectives=[], hbm_bytes=spec.hbm_bytes if spec else None, fits=False,
            compile_seconds=time.perf_counter() - start,
            notes=["does not fit: " + str(err).split("RESOURCE_EXHAUSTED:", 1)[-1].strip().splitlines()[0]],
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
        "batch_bytes": math.prod(tokens.shape) * 4 / _ways(engine.batch_sharding),
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
    notes = []
    if device.platform == "cpu":
        notes.append("XLA:CPU lowers reduce-scatters it creates itself as all-reduce + slice; compile for a "
                     "TPU slice (--topology) to see the accelerator program")
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
    ways = 1
    for entry in sharding.spec:
        for axis in (entry,) if isinstance(entry, str) else entry or ():
            ways *= sharding.mesh.shape[axis]
    return ways

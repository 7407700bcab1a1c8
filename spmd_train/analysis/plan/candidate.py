"""A layout to estimate (`Candidate`), the work it runs (`Workload`), and where each parameter tree lives.

The layout arithmetic is `sharding.layout.Layout`'s over axis sizes instead of a mesh, with the rule tables a
config loads (`config.resolved_rules`; the default preset unless a candidate carries others). Also here, what
follows from a candidate and a workload alone: rows per device, pipeline microbatches, MoE capacity slots and a
schedule's ticks, bubble and stash slots (cached per schedule).

Derivation: docs/explanation/planner-model.md#candidates-and-workloads
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import get_args

from spmd_train.analysis.plan.shape import ModelShape
from spmd_train.config.attention_facts import attention_facts, attention_names, fallback_attention
from spmd_train.config.load import default_rules
from spmd_train.config.mesh_schema import (
    MESH_AXES,
    OFFLOADS_ACTIVATIONS,
    STACKING_AXES,
    ZERO_AXES,
    ContextScheme,
    RematPolicy,
)
from spmd_train.config.model_schema import MoEImpl
from spmd_train.config.optimizer_facts import optimizer_facts, optimizer_names
from spmd_train.config.pipeline_keys import default_microbatches
from spmd_train.config.precision_schema import matmul_mode
from spmd_train.config.resolved_rules import ResolvedRules, RuleTables
from spmd_train.config.schedule_facts import schedule_names
from spmd_train.config.schema import Config
from spmd_train.errors import ConfigError
from spmd_train.ops.capacity import capacity
from spmd_train.parallel.schedule_simulator import occupancy
from spmd_train.parallel.schedules import build_schedule

REMAT_POLICIES = get_args(RematPolicy)
SEARCHED_REMATS = tuple(r for r in REMAT_POLICIES if r not in OFFLOADS_ACTIVATIONS and r != "names")
"""The policies `plan` searches on every platform; those that offload activations (`OFFLOADS_ACTIVATIONS`) only
where the workload has host memory (`Workload.host_memory`). `names` is estimated when a config gives its names,
never searched."""
OFFLOAD_SHARES = (0.0, 1.0)
"""offload.optimizer's shares `plan` searches where the workload can offload it (`Workload.offloads_state`): none
or all of the state."""
CONTEXT_SCHEMES = get_args(ContextScheme)

Spec = tuple[tuple[str, ...], ...]
"""Per dimension of an array, the mesh axes (of size > 1) splitting it."""


@dataclass(frozen=True)
class Candidate:
    """One layout: mesh axis sizes, ZeRO stage, remat, pipeline schedule, context scheme, accumulation, slow axes."""

    data: int = 1
    pipeline: int = 1
    fsdp: int = 1
    sequence: int = 1
    expert: int = 1
    tensor: int = 1
    zero_stage: int = 3
    remat: str = "none"
    sequence_parallel: bool = False
    context_parallel: str = "allgather"
    pipeline_schedule: str = "1f1b"
    pipeline_microbatches: int | None = None
    """None: our default, the largest of 4p, 2p, p that divides a device's rows (`resolved_microbatches`)."""
    virtual_stages: int = 1
    grad_accum: int = 1
    offload: float = 0.0
    """offload.optimizer: the share of the optimizer state's bytes kept in host memory (0: none, 1: all)."""
    dcn: tuple[int, ...] = (1,) * len(MESH_AXES)
    """Slow-link (DCN / inter-node) factor of each mesh axis, in `MESH_AXES` order (like mesh.dcn); a mapping
    {axis: factor} is accepted and stored as this tuple."""
    rules: RuleTables | None = None
    """The configured sharding rules (`mesh.rules`); None: the default preset, which the planner searches with."""

    def __post_init__(self):
        if isinstance(self.dcn, Mapping):
            unknown = set(self.dcn) - set(MESH_AXES)
            if unknown:
                raise ConfigError(f"dcn names {sorted(unknown)}, not mesh axes (valid: {', '.join(MESH_AXES)})")
            object.__setattr__(self, "dcn", tuple(self.dcn.get(a, 1) for a in MESH_AXES))
        for key, value, valid in (("remat", self.remat, REMAT_POLICIES),
                                  ("pipeline_schedule", self.pipeline_schedule, schedule_names()),
                                  ("context_parallel", self.context_parallel, CONTEXT_SCHEMES),
                                  ("zero_stage", self.zero_stage, (0, 1, 2, 3))):
            if value not in valid:
                raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, valid))}")
        if not 0 <= self.offload <= 1:
            raise ConfigError(f"offload={self.offload!r} is not a share of the optimizer state (valid: 0 to 1)")
        for axis, size, slow in zip(MESH_AXES, self.sizes, self.dcn, strict=True):
            if size < 1 or slow < 1 or size % slow:
                raise ConfigError(f"{axis}={size} with slow-link factor {slow}: sizes and factors are positive and "
                                  f"the factor divides the size")

    @functools.cached_property
    def sizes(self) -> tuple[int, ...]:
        """Axis sizes in `MESH_AXES` order."""
        return (self.data, self.pipeline, self.fsdp, self.sequence, self.expert, self.tensor)

    @functools.cached_property
    def shape(self) -> dict[str, int]:
        """{mesh axis: size}."""
        return dict(zip(MESH_AXES, self.sizes, strict=True))

    @property
    def devices(self) -> int:
        """Devices the layout spans."""
        return math.prod(self.sizes)

    @functools.cached_property
    def tables(self) -> ResolvedRules:
        """The effective rule tables on this mesh: the configured ones with the rules the code adds."""
        return _tables(self.rules, self.sequence_parallel, self.pipeline)

    def split_by(self, logical: str) -> tuple[str, ...]:
        """The mesh axes of size > 1 the activation rule of this logical axis splits it over, in mesh order."""
        return _split_by(logical, self.sizes, self.rules, self.sequence_parallel)

    @property
    def batch_ways(self) -> int:
        """Devices a global batch's rows are split over (the `batch` rule; by default data x fsdp x expert)."""
        return _ways_of("batch", self.sizes, self.rules, self.sequence_parallel)

    @property
    def length_ways(self) -> int:
        """Devices a row's tokens are split over (the `length` rule; by default `sequence`)."""
        return _ways_of("length", self.sizes, self.rules, self.sequence_parallel)

    def split(self, axes: tuple[str, ...]) -> tuple[int, int]:
        """(fast, slow): how many devices of a group over these axes share a fast-link domain, and how many
        such domains the group spans over the slow link."""
        slow = math.prod(self.dcn[MESH_AXES.index(a)] for a in axes)
        return math.prod(self.shape[a] for a in axes) // slow, slow

    @classmethod
    def from_config(cls, cfg: Config, sizes: Mapping[str, int]) -> Candidate:
        """The layout `cfg` runs on a mesh with these resolved axis sizes, under its sharding rules."""
        par = cfg.parallel
        rules = RuleTables.from_config(cfg.mesh.rules)
        return cls(**{a: sizes[a] for a in MESH_AXES}, zero_stage=par.zero_stage, remat=par.remat,
                   sequence_parallel=par.sequence_parallel, context_parallel=par.context_parallel,
                   pipeline_schedule=par.pipeline_schedule, pipeline_microbatches=par.pipeline_microbatches,
                   virtual_stages=par.virtual_stages, grad_accum=cfg.train.grad_accum,
                   offload=cfg.offload.optimizer_share, dcn={a: getattr(cfg.mesh.dcn, a) for a in MESH_AXES},
                   rules=None if rules == default_rules() else rules)


@dataclass(frozen=True)
class Workload:
    """What every candidate runs: the batch, the optimizer and the implementations that change memory or bytes."""

    global_batch: int
    seq_len: int
    optimizer: str = "adamw"
    momentum: bool = False
    """optim.b1 is set and adds a (fp32) momentum (`OptimizerFacts.b1_adds_state`: Adafactor)."""
    master: bool = False
    """precision.master=float32: the optimizer state holds a float32 copy of the parameters, its moments float32."""
    moments: str | None = None
    """precision.moments: the moments' dtype (None: the parameters', float32 over a master copy)."""
    reduce: str | None = None
    """precision.reduce: the dtype the layers' weight gradients are summed in (None: the compute dtype)."""
    matmul: str = "default"
    """precision.matmul as `config.precision_schema.matmul_mode` names it: fp8 (per-tensor scales) gathers the
    weights `takes_quantized` names in one byte an element; fp8 and int8 time their matmuls at the chip's FP8 or int8
    peak (`timing.compute_seconds`); fp8-row at the bf16 rate (XLA's FP8 GEMM rewrite takes per-tensor scales)."""
    attention: str = "flash"
    """"flash": a fused kernel (Pallas, cuDNN) keeps no [length, length] scores; "xla": the reference attention."""
    moe_impl: str = "capacity"
    capacity_factor: float = 1.25
    documents: bool = False
    """Packed documents are masked (context parallelism then exchanges their ids)."""
    host_memory: bool = False
    """The platform has host memory to offload to (an accelerator's; on XLA:CPU the host is the device), so `plan`
    searches the activation-offloading remat policies, and offload.optimizer where `offloads_state`."""
    offload_groups: int = 0
    """offload.optimizer_groups: the slices the offloaded state streams in (0: one per layer, at most 64)."""
    offload_params: bool = False
    """offload.params: the layer stack's parameters in host memory, fetched a layer at a time."""
    remat_save: tuple[str, ...] = ()
    """parallel.remat=names: the intermediates each layer keeps on the device (`memory.named_bytes`)."""
    remat_offload: tuple[str, ...] = ()
    """parallel.remat=names: the intermediates each layer keeps in host memory."""
    xla_cpu: bool = False
    """Compiled by XLA:CPU (simulated devices), which partitions parameter traffic as `analysis.zero_floor` counts
    it; an accelerator's compiler keeps the LM head it gathered, re-splits lookup tables and reduces some gradients
    otherwise (`comm.zero_terms`)."""

    def __post_init__(self):
        for key, value, valid in (("optimizer", self.optimizer, optimizer_names()),
                                  ("attention", self.attention, ("flash", "xla")),
                                  ("moe_impl", self.moe_impl, get_args(MoEImpl))):
            if value not in valid:
                raise ConfigError(f"{key}={value!r} is not one of {', '.join(valid)}")

    @property
    def offloads_state(self) -> bool:
        """Whether `plan` searches offload.optimizer: host memory, and an optimizer whose update is elementwise
        (`OptimizerFacts.elementwise`, what `train.offload` streams)."""
        return self.host_memory and optimizer_facts(self.optimizer).elementwise

    @classmethod
    def from_config(cls, cfg: Config, platform: str = "cpu") -> Workload:
        """The workload of `cfg` on `platform` (cpu, gpu, tpu): `attention=auto` is XLA on CPU, a kernel elsewhere;
        XLA:CPU partitions the parameter traffic its own way (`xla_cpu`)."""
        impl = cfg.backends.attention
        impl = fallback_attention() if impl == "auto" and platform == "cpu" else impl
        keeps = impl in attention_names() and attention_facts(impl).keeps_scores
        momentum = optimizer_facts(cfg.optim.name).b1_adds_state and cfg.optim.b1 is not None
        return cls(global_batch=cfg.train.global_batch_size, seq_len=cfg.train.seq_len, optimizer=cfg.optim.name,
                   momentum=momentum, master=cfg.precision.master == "float32", moments=cfg.precision.moments,
                   matmul=matmul_mode(cfg.precision.matmul, cfg.precision.fp8_scaling), reduce=cfg.precision.reduce,
                   attention="xla" if keeps else "flash",
                   moe_impl=cfg.backends.moe, capacity_factor=cfg.backends.capacity_factor,
                   documents=cfg.data.masks_documents,
                   host_memory=platform != "cpu",
                   offload_groups=cfg.offload.optimizer_groups or 0, offload_params=cfg.offload.params,
                   remat_save=cfg.parallel.remat_save,
                   remat_offload=cfg.parallel.remat_offload, xla_cpu=platform == "cpu")


def searched_settings(c: Candidate, w: Workload) -> tuple[tuple[str, float], ...]:
    """The (remat policy, offload share) pairs `plan` tries for a layout: every searched policy, the activation
    offloads where the workload has host memory and no pipeline stashes the activations (the memory model counts
    no saving there), each with every searched share of the optimizer state on the host where it can go there."""
    remats = SEARCHED_REMATS
    if w.host_memory and c.pipeline == 1:
        remats += tuple(r for r in REMAT_POLICIES if r in OFFLOADS_ACTIVATIONS)
    shares = OFFLOAD_SHARES if w.offloads_state else (0.0,)
    return tuple((r, s) for r in remats for s in shares)


def less_offloaded(remat: str, share: float) -> list[tuple[str, float]]:
    """The settings that offload less than (remat, share) and run the same computation otherwise: full remat for an
    activation-offloading policy (the same recompute), no optimizer offload for a share (the same update)."""
    remats = [remat, "full"] if remat in OFFLOADS_ACTIVATIONS else [remat]
    return [(r, s) for r in remats for s in sorted({0.0, share}) if (r, s) != (remat, share)]


# --- layout arithmetic ------------------------------------------------------------------------------------------


def ways(axes, shape: Mapping[str, int]) -> int:
    """How many pieces these mesh axes split a dimension into."""
    return math.prod(shape[a] for a in axes)


def spec_ways(spec: Spec, shape: Mapping[str, int]) -> int:
    """How many pieces a layout splits the whole array into."""
    return math.prod(shape[a] for dim in spec for a in dim)


@dataclass(frozen=True)
class GroupLayout:
    """Where one parameter array lives: stored per tree, and in its compute layout."""

    params: Spec
    grads: Spec
    optimizer: Spec
    compute: frozenset[str]
    """Mesh axes splitting the weight as the matmuls use it (ZeRO axes gathered, `tensor`/`expert`/`pipeline` kept)."""


def group_layout(axes: tuple[str, ...], c: Candidate) -> GroupLayout:
    """The layout of a parameter with these logical axes under candidate `c` (`Layout.param_spec`)."""
    return param_layout(axes, c.sizes, c.zero_stage, c.rules)


@functools.lru_cache(maxsize=1 << 14)
def param_layout(axes: tuple[str, ...], sizes: tuple[int, ...], zero_stage: int, rules: RuleTables | None
                 ) -> GroupLayout:
    """`group_layout` from a candidate's fields alone (for caches keyed on them)."""
    sharded, whole, compute = _layouts(axes, sizes, rules)
    return GroupLayout(params=sharded if zero_stage >= 3 else whole, grads=sharded if zero_stage >= 2 else whole,
                       optimizer=sharded if zero_stage >= 1 else whole, compute=compute)


@functools.lru_cache(maxsize=1 << 12)
def _layouts(axes: tuple[str, ...], sizes: tuple[int, ...], rules: RuleTables | None
             ) -> tuple[Spec, Spec, frozenset[str]]:
    """(stored with the ZeRO axes, stored without them, compute axes): what every ZeRO stage picks from."""
    shape = dict(zip(MESH_AXES, sizes, strict=True))
    tables = tables_of(sizes, rules)

    def spec(zero: bool) -> Spec:
        return tuple(tuple(a for a in tables.params.get(n, ()) if shape[a] > 1 and (zero or a not in ZERO_AXES))
                     for n in axes)

    sharded = spec(True)
    compute = {a for n in axes if n not in STACKING_AXES for a in tables.activations.get(n, ()) if shape[a] > 1}
    # The stacking axes keep their stored split: `pipeline` is not a ZeRO axis, so it is the same in both specs.
    compute |= {a for n, dim in zip(axes, sharded, strict=True) if n in STACKING_AXES for a in dim}
    return sharded, spec(False), frozenset(compute)


@functools.lru_cache(maxsize=1 << 14)
def _split_by(logical: str, sizes: tuple[int, ...], rules: RuleTables | None, sequence_parallel: bool
              ) -> tuple[str, ...]:
    """`Candidate.split_by`, cached on the fields it reads: the search asks it of a quarter of a million candidates."""
    tables = _tables(rules, sequence_parallel, sizes[MESH_AXES.index("pipeline")])
    return live(tables.activations.get(logical, ()), dict(zip(MESH_AXES, sizes, strict=True)))


@functools.lru_cache(maxsize=1 << 14)
def _ways_of(logical: str, sizes: tuple[int, ...], rules: RuleTables | None, sequence_parallel: bool) -> int:
    """How many devices split this logical axis (`Candidate.batch_ways`, `length_ways`)."""
    return math.prod(sizes[MESH_AXES.index(a)] for a in _split_by(logical, sizes, rules, sequence_parallel))


def live(axes, shape: Mapping[str, int]) -> tuple[str, ...]:
    """The axes of size > 1 among `axes`, in mesh order."""
    return tuple(a for a in MESH_AXES if a in axes and shape[a] > 1)


def tables_of(sizes: tuple[int, ...], rules: RuleTables | None) -> ResolvedRules:
    """The parameter and activation tables on a mesh of these sizes (sequence parallelism aside, which changes the
    residual stream's `norm_length` only)."""
    return _tables(rules, False, sizes[MESH_AXES.index("pipeline")])


def _tables(rules: RuleTables | None, sequence_parallel: bool, pipeline: int) -> ResolvedRules:
    """The effective tables of `rules` (None: the default preset) with the rules the code adds."""
    return (rules or default_rules()).resolve(sequence_parallel=sequence_parallel, pipeline=pipeline)


def rows_per_device(c: Candidate, w: Workload) -> int:
    """Rows of the global batch a device holds per accumulation step (`sharding.arithmetic.rows_per_device`)."""
    return w.global_batch // (c.grad_accum * c.batch_ways)


def microbatches(c: Candidate, rows: int) -> int:
    """Pipeline microbatches per accumulation step (`config.pipeline_keys.resolved_microbatches`); 1 without
    stages."""
    if c.pipeline == 1:
        return 1
    if c.pipeline_microbatches is not None:
        return c.pipeline_microbatches
    return default_microbatches(c.pipeline, rows)


def residual_ways(c: Candidate) -> int:
    """Devices the residual stream's length is split over: `sequence`, times `tensor` under sequence parallelism."""
    return c.sequence * (c.tensor if c.sequence_parallel else 1)


def capacity_slots(m: ModelShape, w: Workload, group_tokens: float) -> float:
    """Slots per expert and group (`ops.routing.capacity`: ceil(k·tokens·factor / E)); k·tokens/E when dropless."""
    if w.moe_impl == "dropless":
        return m.experts_per_token * group_tokens / m.num_experts
    return capacity(m.experts_per_token, group_tokens, w.capacity_factor, m.num_experts)


@functools.lru_cache(maxsize=4096)
def schedule_stats(name: str, stages: int, micro: int, virtual: int) -> tuple[int, float, int]:
    """(ticks, bubble fraction, most (microbatch, chunk) stashes a stage holds) of the schedule's tick table.

    The figures `parallel.schedule_simulator.simulate` reports as num_ticks, bubble_fraction and
    max(peak_in_flight), from the same `occupancy` count (tests/test_plan_search.py holds them equal), without
    simulate's validation and transfer list: those took a fifth of the planner's time over the pipeline meshes of a
    512-device slice.
    """
    schedule = build_schedule(name, stages, micro, virtual)
    busy, peak, _ = occupancy(schedule)
    slots = stages * schedule.num_ticks
    return schedule.num_ticks, (slots - sum(busy)) / slots, max(peak)

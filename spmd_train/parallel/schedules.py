"""Pipeline schedules as data: which stage runs which forward/backward op at each tick.

Pure Python (no jax): the pipeline executor consumes these tables, and `simulate` checks a table
against the timing model before anyone trusts it.

Timing model. Every op (the forward "F" or backward "B" of one microbatch on one chunk) takes one
tick, and a stage runs at most one op per tick. An op's output is sent to the neighbouring stage
during the tick that produced it and is usable from the next tick on. Chunk c (a "virtual stage",
0..stages*virtual-1) runs on `stage_of(c)`: c % stages for the "loop" placement, so device d holds
chunks d, d+p, d+2p, ...; for the "v" placement (zb_v) device d holds chunks d and 2p-1-d.
F(mb, c) needs F(mb, c-1); B(mb, c) needs F(mb, c) and, below the last chunk, B(mb, c+1).

Split backward (zb_h1, zb_v): "B" is only the gradient w.r.t. the chunk's input and a third op
"W", the gradient w.r.t. its weights, needs B(mb, c) from an earlier tick on the same stage; nothing
waits for W. Elsewhere "B" is the fused backward (input and weight gradients in one op).

Builders give each stage an op ORDER (GPipe, PipeDream-Flush 1F1B, Megatron-LM interleaved 1F1B,
and the zero-bubble orders of `zero_bubble`) and list-schedule it: at each tick every stage runs its
next op if that op's inputs were produced at an earlier tick, else it idles. The tick tables
therefore follow from the orders and the timing model alone; the tests prove the resulting tick
counts equal the closed-form bubbles.

Cost model (`ScheduleStats.*_units`): F = B = W = 1 time unit for split schedules, fused B = 2
(= B + W) elsewhere, so a microbatch-chunk costs 3 units in every schedule; a unit is the forward
time of one chunk (1/virtual of a stage's layers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from spmd_train.config.checks import divisors
from spmd_train.config.schema import Config
from spmd_train.errors import ConfigError
from spmd_train.parallel.zero_bubble import zb_h1_orders, zb_v_orders

SPLIT_BACKWARD = ("zb_h1", "zb_v")
"""Schedules with the backward split into B and W (the executor runs them with `pipeline_split`)."""
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", *SPLIT_BACKWARD)
"""The schedules training runs (parallel.pipeline_schedule)."""
SIMULATED_SCHEDULES = SCHEDULES
"""What `build_schedule` and `spmd-train schedule` accept: every schedule training runs."""

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"


class Op(NamedTuple):
    """One unit of pipeline work: the forward or backward of one microbatch on one chunk."""

    kind: str  # "F" (forward), "B" (backward; input gradient only if split) or "W" (weight gradient)
    microbatch: int  # 0..microbatches-1
    chunk: int  # global virtual-stage index 0..stages*virtual-1; runs on Schedule.stage_of(chunk)


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ticks[t][s] is the op stage s runs at tick t (None = idle)."""

    name: str
    stages: int
    microbatches: int
    virtual: int
    ticks: tuple[tuple[Op | None, ...], ...]

    @property
    def num_ticks(self) -> int:
        """Length of the schedule in ticks (one op per stage per tick)."""
        return len(self.ticks)

    @property
    def split_backward(self) -> bool:
        """Whether backward is B (input gradient) plus W (weight gradient) rather than one fused B."""
        return self.name in SPLIT_BACKWARD

    @property
    def placement(self) -> str:
        """Where chunks live: "loop" (chunk c on stage c % stages) or "v" (chunks d and 2p-1-d on stage d)."""
        return placement_of(self.name)

    def stage_of(self, chunk: int) -> int:
        """The stage that runs `chunk`."""
        return stage_of(chunk, self.stages, self.placement)


def placement_of(name: str) -> str:
    """The chunk placement of schedule `name`: "v" for zb_v, else "loop"."""
    return "v" if name == "zb_v" else "loop"


def stage_of(chunk: int, stages: int, placement: str) -> int:
    """The stage holding `chunk` under `placement` ("loop": chunk % stages; "v": chunk, then back up)."""
    if placement == "v":
        return chunk if chunk < stages else 2 * stages - 1 - chunk
    return chunk % stages


@dataclass(frozen=True)
class Transfer:
    """A tensor sent between stages during `tick` by the op of (microbatch, chunk) that produced it."""

    tick: int
    src: int
    dst: int
    kind: str  # "activation" (F of chunk -> F of chunk+1) or "gradient" (B of chunk -> B of chunk-1)
    microbatch: int
    chunk: int  # the chunk that produced it


@dataclass(frozen=True)
class ScheduleStats:
    """Figures of a validated schedule: length, bubble, activation memory, traffic, busy time."""

    num_ticks: int
    bubble_fraction: float  # idle (stage, tick) slots / (stages * num_ticks)
    peak_in_flight: tuple[int, ...]  # per stage: most (microbatch, chunk) pairs with F done and W (fused B) not
    transfers: tuple[Transfer, ...]
    busy_ticks: tuple[int, ...]  # per stage
    # Per stage: most pairs with F done and B not yet, i.e. holding the whole activation. B frees what
    # only the input gradient needed; W needs the rest (matmul inputs and output gradients) and frees
    # it. peak_in_flight counts conservatively from F to W; equal to this for fused schedules.
    peak_whole_activations: tuple[int, ...] = ()
    # Cost model (module docstring), asynchronous: each stage runs its ops in table order back to
    # back, each as soon as its inputs are finished (the ZB paper's model). makespan = the last finish.
    makespan_units: int = 0
    bubble_units: tuple[int, ...] = ()  # per stage: makespan_units - the stage's work, idle time
    # Lockstep: one SPMD program, one op per stage per tick, a collective each tick, so every tick
    # lasts as long as its longest op.
    lockstep_units: int = 0
    lockstep_bubble_fraction: float = 0.0  # 1 - all work / (stages * lockstep_units)


# ---------------------------------------------------------------------------------------------
# Building


def build_schedule(name: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The tick table of schedule `name` for `stages` stages, `microbatches` microbatches, `virtual` chunks/stage."""
    _check_request(name, stages, microbatches, virtual)
    p, m, v = stages, microbatches, virtual
    forwards = [[Op(FORWARD, i, s) for i in range(m)] for s in range(p)]  # used when v == 1
    backwards = [[Op(BACKWARD, i, s) for i in range(m)] for s in range(p)]
    if name == "gpipe":
        # All forwards, then all backwards: every stage holds all m activations at the turn.
        orders = [forwards[s] + backwards[s] for s in range(p)]
    elif name == "1f1b":
        # PipeDream-Flush: p-s-1 warm-up forwards, so stage s never holds more than p-s activations.
        orders = [_one_forward_one_backward(forwards[s], backwards[s], warmup=p - s - 1) for s in range(p)]
    elif name == "interleaved_1f1b":
        orders = [_interleaved_order(d, p, m, v) for d in range(p)]
    elif name == "zb_h1":
        orders = [[Op(*op) for op in order] for order in zb_h1_orders(p, m)]
    else:
        orders = [[Op(*op) for op in order] for order in zb_v_orders(p, m, lambda op: _inputs(Op(*op), 2 * p - 1))]
    return Schedule(name=name, stages=p, microbatches=m, virtual=v, ticks=_list_schedule(orders, last_chunk=p * v - 1))


def _interleaved_order(d: int, p: int, m: int, v: int) -> list[Op]:
    """Megatron-LM's op order for device d: groups of p microbatches sweep the device's v chunks in turn."""
    groups = range(m // p)
    forwards = [Op(FORWARD, g * p + i, d + k * p) for g in groups for k in range(v) for i in range(p)]
    backwards = [Op(BACKWARD, g * p + i, d + k * p) for g in groups for k in reversed(range(v)) for i in range(p)]
    # Megatron's warm-up. The first backward (microbatch 0 on the last local chunk) waits for the
    # first group's forwards on the v-1 earlier local chunks ((v-1)*p ops), then for its forward to
    # reach the last device and its gradient to come back (2 ticks per downstream device).
    # Checked, not assumed: with this plain order, list scheduling attains 2(v*m+p-1) ticks.
    warmup = min((p - d - 1) * 2 + (v - 1) * p, m * v)
    return _one_forward_one_backward(forwards, backwards, warmup)


def _one_forward_one_backward(forwards: list[Op], backwards: list[Op], warmup: int) -> list[Op]:
    """`warmup` forwards, then alternate one forward and one backward, then the remaining backwards."""
    steady = len(forwards) - warmup
    order = forwards[:warmup]
    for i in range(steady):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[steady:]


def _list_schedule(orders: Sequence[Sequence[Op]], last_chunk: int) -> tuple[tuple[Op | None, ...], ...]:
    """Tick by tick, each stage runs its next op in order once that op's inputs exist, else idles."""
    done: dict[Op, int] = {}
    position = [0] * len(orders)
    ticks: list[tuple[Op | None, ...]] = []
    while any(pos < len(order) for pos, order in zip(position, orders, strict=False)):
        tick = len(ticks)
        nexts = [order[pos] if pos < len(order) else None for pos, order in zip(position, orders, strict=False)]
        row = tuple(op if op is not None and all(done.get(dep, tick) < tick for dep in _inputs(op, last_chunk))
                    else None for op in nexts)
        if not any(row):  # cannot happen for the orders above; guards against an order that deadlocks
            raise RuntimeError(f"pipeline op orders deadlock at tick {tick}: next ops {nexts}")
        for s, op in enumerate(row):
            if op is not None:
                done[op] = tick
                position[s] += 1
        ticks.append(row)
    return tuple(ticks)


def _inputs(op: Op, last_chunk: int) -> tuple[Op, ...]:
    """The ops whose outputs `op` consumes (they must run at earlier ticks)."""
    if op.kind == WEIGHT:
        return (Op(BACKWARD, op.microbatch, op.chunk),)
    if op.kind == FORWARD:
        return (Op(FORWARD, op.microbatch, op.chunk - 1),) if op.chunk > 0 else ()
    if op.chunk == last_chunk:
        return (Op(FORWARD, op.microbatch, op.chunk),)
    return Op(FORWARD, op.microbatch, op.chunk), Op(BACKWARD, op.microbatch, op.chunk + 1)


_COUNTS = {"mesh.pipeline": "pipeline stages", "parallel.pipeline_microbatches": "microbatches per step",
           "parallel.virtual_stages": "model chunks per stage"}


def _check_request(name: str, stages: int, microbatches: int, virtual: int) -> None:
    if name not in SIMULATED_SCHEDULES:
        raise ConfigError(f"parallel.pipeline_schedule={name!r} is not a pipeline schedule "
                          f"(valid: {', '.join(SCHEDULES)})")
    for key, value in (("mesh.pipeline", stages), ("parallel.pipeline_microbatches", microbatches),
                       ("parallel.virtual_stages", virtual)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{key}={value!r} is invalid: it counts {_COUNTS[key]} (valid: an integer >= 1)")
    where = f"for parallel.pipeline_schedule={name} with mesh.pipeline={stages}"
    if name in ("gpipe", "1f1b", "zb_h1") and virtual != 1:
        raise ConfigError(f"parallel.virtual_stages={virtual} is invalid for parallel.pipeline_schedule={name}: "
                          f"only interleaved_1f1b and zb_v run several chunks per stage (valid: 1)")
    if name in ("1f1b", "zb_h1") and microbatches < stages:
        what = "1F1B" if name == "1f1b" else "ZB-H1 (1F1B's warm-up)"
        raise ConfigError(f"parallel.pipeline_microbatches={microbatches} is invalid {where}: {what} needs at least "
                          f"as many microbatches as stages (valid: >= {stages})")
    if name == "zb_v" and virtual != 2:
        raise ConfigError(f"parallel.virtual_stages={virtual} is invalid for parallel.pipeline_schedule=zb_v: "
                          f"a V schedule runs exactly 2 chunks per stage (valid: 2)")
    if name == "zb_v" and microbatches < stages:
        raise ConfigError(f"parallel.pipeline_microbatches={microbatches} is invalid {where}: ZB-V needs at least "
                          f"as many microbatches as stages to fill the V before its first backward "
                          f"(valid: >= {stages})")
    if name == "interleaved_1f1b":
        if virtual < 2:
            raise ConfigError(f"parallel.virtual_stages={virtual} is invalid for parallel.pipeline_schedule="
                              f"interleaved_1f1b: interleaving needs at least 2 chunks per stage "
                              f"(valid: >= 2; for one chunk use 1f1b)")
        if microbatches % stages:
            raise ConfigError(f"parallel.pipeline_microbatches={microbatches} is not divisible by "
                              f"mesh.pipeline={stages}: interleaved_1f1b runs microbatches in groups of {stages} "
                              f"(valid: a multiple of {stages})")



# ---------------------------------------------------------------------------------------------
# Validating and measuring


def simulate(schedule: Schedule) -> ScheduleStats:
    """Validate `schedule` against the timing model (ConfigError naming tick, stage, op) and measure it."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual
    for key, value in (("stages", p), ("microbatches", m), ("virtual", v)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"schedule {schedule.name!r}: {key}={value!r} is invalid (valid: an integer >= 1)")
    done: dict[Op, tuple[int, int]] = {}  # op -> (tick, stage)
    transfers: list[Transfer] = []
    for tick, row in enumerate(schedule.ticks):
        if len(row) != p:
            raise ConfigError(f"schedule {schedule.name!r}: tick {tick} has {len(row)} entries, one per stage "
                              f"expected (valid: {p})")
        for stage, op in enumerate(row):
            if op is None:
                continue
            op = _check_op(schedule, tick, stage, op, done)
            done[op] = (tick, stage)
            transfers.extend(_sends(schedule, op, tick))
    _check_complete(schedule, done)
    busy, peak, peak_whole = occupancy(schedule)
    slots = p * schedule.num_ticks
    makespan, work = _asynchronous(schedule)
    lockstep = sum(max((_cost(op, schedule.split_backward) for op in row if op is not None), default=0)
                   for row in schedule.ticks)
    return ScheduleStats(num_ticks=schedule.num_ticks, bubble_fraction=(slots - sum(busy)) / slots,
                         peak_in_flight=peak, transfers=tuple(transfers), busy_ticks=busy,
                         peak_whole_activations=peak_whole, makespan_units=makespan,
                         bubble_units=tuple(makespan - w for w in work), lockstep_units=lockstep,
                         lockstep_bubble_fraction=1 - sum(work) / (p * lockstep) if lockstep else 0.0)


def occupancy(schedule: Schedule) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Per stage, of a valid tick table (`simulate` validates): (ticks busy, most stashes held at the end of a tick,
    most whole activations held). A stash is freed by the op that reads the last of it (W when the backward is
    split, else B); a whole activation by B. The planner reads this without `simulate`'s checks and transfers."""
    p = schedule.stages
    releases = WEIGHT if schedule.split_backward else BACKWARD
    in_flight, whole, busy = [0] * p, [0] * p, [0] * p
    peak, peak_whole = [0] * p, [0] * p
    for row in schedule.ticks:
        for stage, op in enumerate(row):
            if op is None:
                continue
            busy[stage] += 1
            in_flight[stage] += 1 if op.kind == FORWARD else -1 if op.kind == releases else 0
            whole[stage] += 1 if op.kind == FORWARD else -1 if op.kind == BACKWARD else 0
        peak = [max(a, b) for a, b in zip(peak, in_flight, strict=True)]  # counted at the end of each tick
        peak_whole = [max(a, b) for a, b in zip(peak_whole, whole, strict=True)]
    return tuple(busy), tuple(peak), tuple(peak_whole)


def _check_complete(schedule: Schedule, done: dict[Op, tuple[int, int]]) -> None:
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual
    missing = [op for op in _all_ops(p, m, v, schedule.split_backward) if op not in done]
    if missing:
        listed = ", ".join(f"{_label(op)} on stage {schedule.stage_of(op.chunk)}" for op in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        every = "F, B and W" if schedule.split_backward else "forward and backward"
        raise ConfigError(f"schedule {schedule.name!r} never runs {listed}{more}: every {every} of "
                          f"each of {m} microbatches on each of {p * v} chunks must run exactly once")


def _cost(op: Op, split_backward: bool) -> int:
    """Time units of `op`: F = B = W = 1 when the backward is split, the fused B = 2 (= B + W)."""
    return 2 if op.kind == BACKWARD and not split_backward else 1


def _asynchronous(schedule: Schedule) -> tuple[int, list[int]]:
    """(makespan, work per stage) in time units when each stage runs its ops in table order, each as soon
    as the stage is free and its inputs have finished (transfers take no time)."""
    free, work = [0] * schedule.stages, [0] * schedule.stages
    finish: dict[Op, int] = {}
    last_chunk = schedule.stages * schedule.virtual - 1
    for row in schedule.ticks:  # tick order is a topological order: inputs run at earlier ticks
        for stage, op in enumerate(row):
            if op is None:
                continue
            op, cost = Op(*op), _cost(Op(*op), schedule.split_backward)
            start = max([free[stage], *(finish[dep] for dep in _inputs(op, last_chunk))])
            finish[op] = free[stage] = start + cost
            work[stage] += cost
    return max(free, default=0), work


def _check_op(schedule: Schedule, tick: int, stage: int, op: object, done: dict[Op, tuple[int, int]]) -> Op:
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual
    where = f"schedule {schedule.name!r}, tick {tick}, stage {stage}"
    kinds = (FORWARD, BACKWARD, WEIGHT) if schedule.split_backward else (FORWARD, BACKWARD)
    if (not isinstance(op, tuple) or len(op) != 3 or op[0] not in kinds
            or not all(isinstance(x, int) for x in op[1:])):
        valid = "'F', 'B' or 'W'" if schedule.split_backward else "'F' or 'B'"
        raise ConfigError(f"{where}: {op!r} is not an op (valid: Op(kind={valid}, microbatch, chunk) or None)")
    op = Op(*op)
    if not 0 <= op.microbatch < m or not 0 <= op.chunk < p * v:
        raise ConfigError(f"{where}: {_label(op)} is out of range (valid: microbatch 0..{m - 1}, "
                          f"chunk 0..{p * v - 1})")
    home = schedule.stage_of(op.chunk)
    if home != stage:
        rule = f"chunk % {p}" if schedule.placement == "loop" else f"V placement: chunk c or {2 * p - 1} - c"
        raise ConfigError(f"{where}: {_label(op)} is on the wrong stage: chunk {op.chunk} runs on stage "
                          f"{home} ({rule})")
    if op in done:
        first_tick, first_stage = done[op]
        raise ConfigError(f"{where}: {_label(op)} runs twice (first at tick {first_tick} on stage {first_stage})")
    for dep in _inputs(op, p * v - 1):
        if dep not in done:
            raise ConfigError(f"{where}: {_label(op)} needs the output of {_label(dep)} from an earlier tick, "
                              f"but {_label(dep)} has not run yet")
        if done[dep][0] >= tick:
            raise ConfigError(f"{where}: {_label(op)} needs the output of {_label(dep)} from an earlier tick, "
                              f"but {_label(dep)} runs in the same tick")
    return op


def _sends(schedule: Schedule, op: Op, tick: int) -> list[Transfer]:
    """What `op` sends through the pipeline to the stage of its consumer: F's activation, B's gradient.

    The loop placement routes every chunk boundary through the executor's stage-to-stage send, so a
    hop between two chunks of one stage (only when stages == 1) is listed with src == dst. The V
    placement keeps chunk p-1 -> p on one stage by design: that hand-off moves no data between stages
    and is not a transfer, so it is not listed. W sends nothing.
    """
    last_chunk = schedule.stages * schedule.virtual - 1
    if op.kind == FORWARD and op.chunk < last_chunk:
        kind, dst_chunk = "activation", op.chunk + 1
    elif op.kind == BACKWARD and op.chunk > 0:
        kind, dst_chunk = "gradient", op.chunk - 1
    else:
        return []
    src, dst = schedule.stage_of(op.chunk), schedule.stage_of(dst_chunk)
    if schedule.placement == "v" and src == dst:
        return []
    return [Transfer(tick, src, dst, kind, op.microbatch, op.chunk)]


def _all_ops(p: int, m: int, v: int, split_backward: bool = False) -> list[Op]:
    kinds = (FORWARD, BACKWARD, WEIGHT) if split_backward else (FORWARD, BACKWARD)
    return [Op(kind, i, c) for kind in kinds for c in range(p * v) for i in range(m)]


def _label(op: Op) -> str:
    return f"{op.kind}(microbatch={op.microbatch}, chunk={op.chunk})"


# ---------------------------------------------------------------------------------------------
# Rendering


def render_timeline(schedule: Schedule) -> str:
    """The table as text: one row per stage, one column per tick; "F3", "B3", "W3" (or "F3.5": chunk 5), "." idle."""
    def cell(op: Op | None) -> str:
        if op is None:
            return "."
        return f"{op.kind}{op.microbatch}" + (f".{op.chunk}" if schedule.virtual > 1 else "")

    rows = [[cell(op) for op in column] for column in zip(*schedule.ticks, strict=False)] if schedule.ticks else []
    width = max([len(str(schedule.num_ticks - 1)), *(len(c) for r in rows for c in r)], default=1)
    labels = [f"stage {s}" for s in range(schedule.stages)]
    margin = max(len("tick"), *(len(label) for label in labels))
    header = "tick".ljust(margin) + "".join(f" {t:>{width}}" for t in range(schedule.num_ticks))
    lines = [header] + [label.ljust(margin) + "".join(f" {c:>{width}}" for c in r)
                        for label, r in zip(labels, rows, strict=False)]
    return "\n".join(line.rstrip() for line in lines)


# --- the pipeline keys, checked where the config meets the mesh ------------------------------------


def check_pipeline(cfg: Config, sizes: Mapping[str, int], rows: int) -> None:
    """Pipeline keys against the model depth and the `rows` of the batch each device holds per step
    (`sharding.arithmetic.rows_per_device`); the schedule checks its own numbers."""
    p, par, m, t = sizes["pipeline"], cfg.parallel, cfg.model, cfg.train
    v = par.virtual_stages
    if par.pipeline_schedule == "zb_v" and v != 2:
        raise ConfigError(f"parallel.virtual_stages={v} is invalid for parallel.pipeline_schedule=zb_v, which "
                          "runs exactly 2 chunks per stage in a V (valid: set parallel.virtual_stages=2)")
    if par.pipeline_schedule not in ("interleaved_1f1b", "zb_v") and v != 1:
        raise ConfigError(f"parallel.virtual_stages={v} is invalid for parallel.pipeline_schedule="
                          f"{par.pipeline_schedule} (valid: 1; use interleaved_1f1b for virtual stages)")
    if par.pipeline_schedule == "interleaved_1f1b" and v < 2:
        raise ConfigError(f"parallel.virtual_stages={v} is invalid for interleaved_1f1b (valid: >= 2)")
    equal = equal_stages(cfg)
    if not equal:
        _check_pipeline_layers(cfg, p, v)
    elif m.num_layers % (p * v):
        preset = "" if m.preset is None else f", not preset {m.preset!r} as is"
        raise ConfigError(
            f"model.num_layers={m.num_layers} is not divisible by mesh.pipeline={p} x parallel.virtual_stages={v} "
            f"= {p * v}: every stage{' chunk' if v > 1 else ''} gets the same number of layers "
            f"(valid: a model with a multiple of {p * v} layers{preset}, "
            f"or mesh.pipeline x virtual_stages in {divisors(m.num_layers)}"
            + (", or parallel.pipeline_layers=balanced or a list of layer counts)" if par.pipeline_layers is None
               else f"; parallel.pipeline_schedule={par.pipeline_schedule} runs equal stage chunks only)")
        )
    micro = resolved_microbatches(cfg, p, rows)
    if micro < 1 or rows % micro:
        raise ConfigError(
            f"parallel.pipeline_microbatches={micro} does not divide the {rows} rows each device gets per step "
            f"(train.global_batch_size={t.global_batch_size} / train.grad_accum={t.grad_accum} / batch axes): "
            f"microbatches must be equal (valid: a divisor of {rows}: {divisors(rows)})"
        )
    depth = m.num_layers // (p * v)
    if equal and m.moe_every > 1 and depth % m.moe_every:
        # The stack's rows are whole MoE groups (every - 1 dense layers, then the MoE layer): a stage holds whole rows.
        raise ConfigError(
            f"model.moe.every={m.moe_every} does not divide the {depth} layer{'s' * (depth > 1)} each pipeline stage"
            f"{' chunk' if v > 1 else ''} holds (model.num_layers={m.num_layers} / mesh.pipeline={p}"
            f"{f' / parallel.virtual_stages={v}' if v > 1 else ''}): an MoE group of {m.moe_every} layers would be "
            f"split across stages (valid model.moe.every: {divisors(depth)}, or a multiple of "
            f"{p * v * m.moe_every} layers)")
    build_schedule(par.pipeline_schedule, p, micro, v)


def equal_stages(cfg: Config) -> bool:
    """Whether every stage chunk holds the same layers: parallel.pipeline_layers null, or "balanced" under a
    split-backward schedule (B and W cannot split a padded chunk's backward, `train.pipelined.chunk_depths`)."""
    layers = cfg.parallel.pipeline_layers
    return layers is None or (layers == "balanced" and cfg.parallel.pipeline_schedule in SPLIT_BACKWARD)


def _check_pipeline_layers(cfg: Config, p: int, v: int) -> None:
    """parallel.pipeline_layers: p x v chunks of whole MoE groups, none empty, adding up to the model (whether the
    schedule can run uneven chunks is `train.pipelined.chunk_depths`' to say, once "balanced" is resolved)."""
    par, m = cfg.parallel, cfg.model
    layers, chunks, unit = par.pipeline_layers, p * v, max(m.moe_every, 1)
    where = f"mesh.pipeline={p}" + (f" x parallel.virtual_stages={v}" if v > 1 else "")
    if layers == "balanced":
        if m.num_layers // unit < chunks:
            raise ConfigError(f"parallel.pipeline_layers=balanced cannot fill {chunks} stage chunks ({where}) with "
                              f"model.num_layers={m.num_layers}" + (f" in groups of model.moe.every={unit}" if unit > 1
                                                                    else "") + f" (valid: at most "
                              f"{m.num_layers // unit} chunks)")
    else:
        shown = "[" + ", ".join(map(str, layers)) + "]"
        if len(layers) != chunks:
            raise ConfigError(f"parallel.pipeline_layers={shown} has {len(layers)} entries; {where} runs {chunks} "
                              f"stage chunks (valid: {chunks} layer counts in model order, summing to "
                              f"model.num_layers={m.num_layers}, or balanced, or null for equal stages)")
        if min(layers) < 1:
            raise ConfigError(f"parallel.pipeline_layers={shown} gives a stage chunk no layers (valid: every entry "
                              f">= {unit}, summing to model.num_layers={m.num_layers})")
        if sum(layers) != m.num_layers:
            raise ConfigError(f"parallel.pipeline_layers={shown} sums to {sum(layers)}, not model.num_layers="
                              f"{m.num_layers} (valid: {chunks} positive layer counts summing to {m.num_layers})")
        if unit > 1 and any(n % unit for n in layers):
            raise ConfigError(f"parallel.pipeline_layers={shown} splits an MoE group: every entry must be a multiple "
                              f"of model.moe.every={unit} (the stack's rows are groups of {unit} layers ending in the "
                              "MoE layer)")


def resolved_microbatches(cfg: Config, stages: int, rows: int) -> int:
    """parallel.pipeline_microbatches, or by default the largest of 4p, 2p, p that divides a device's rows per step."""
    if cfg.parallel.pipeline_microbatches is not None:
        return cfg.parallel.pipeline_microbatches
    for m in (4 * stages, 2 * stages):
        if rows % m == 0:
            return m
    return stages

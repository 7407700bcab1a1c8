"""Pipeline schedules as data: which stage runs which forward/backward op at each tick.

Pure Python (no jax): the pipeline executor consumes these tables, and `simulate` checks a table
against the timing model before anyone trusts it.

Timing model. Every op (the forward "F" or backward "B" of one microbatch on one chunk) takes one
tick, and a stage runs at most one op per tick. An op's output is sent to the neighbouring stage
during the tick that produced it and is usable from the next tick on. Chunk c (a "virtual stage",
0..stages*virtual-1) runs on stage c % stages, so device d holds chunks d, d+p, d+2p, ...
F(mb, c) needs F(mb, c-1); B(mb, c) needs F(mb, c) and, below the last chunk, B(mb, c+1).

Builders give each stage an op ORDER (GPipe, PipeDream-Flush 1F1B, Megatron-LM interleaved 1F1B)
and list-schedule it: at each tick every stage runs its next op if that op's inputs were produced
at an earlier tick, else it idles. The tick tables therefore follow from the orders and the
timing model alone; the tests prove the resulting tick counts equal the closed-form bubbles.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from spmd_train.config.checks import divisors
from spmd_train.config.schema import Config
from spmd_train.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")

FORWARD, BACKWARD = "F", "B"


class Op(NamedTuple):
    """One unit of pipeline work: the forward or backward of one microbatch on one chunk."""

    kind: str  # "F" (forward) or "B" (backward)
    microbatch: int  # 0..microbatches-1
    chunk: int  # global virtual-stage index 0..stages*virtual-1; runs on stage chunk % stages


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
    peak_in_flight: tuple[int, ...]  # per stage: most (microbatch, chunk) pairs with F done and B not yet
    transfers: tuple[Transfer, ...]
    busy_ticks: tuple[int, ...]  # per stage


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
    else:
        orders = [_interleaved_order(d, p, m, v) for d in range(p)]
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
    if op.kind == FORWARD:
        return (Op(FORWARD, op.microbatch, op.chunk - 1),) if op.chunk > 0 else ()
    if op.chunk == last_chunk:
        return (Op(FORWARD, op.microbatch, op.chunk),)
    return Op(FORWARD, op.microbatch, op.chunk), Op(BACKWARD, op.microbatch, op.chunk + 1)


_COUNTS = {"mesh.pipeline": "pipeline stages", "parallel.pipeline_microbatches": "microbatches per step",
           "parallel.virtual_stages": "model chunks per stage"}


def _check_request(name: str, stages: int, microbatches: int, virtual: int) -> None:
    if name not in SCHEDULES:
        raise ConfigError(f"parallel.pipeline_schedule={name!r} is not a pipeline schedule "
                          f"(valid: {', '.join(SCHEDULES)})")
    for key, value in (("mesh.pipeline", stages), ("parallel.pipeline_microbatches", microbatches),
                       ("parallel.virtual_stages", virtual)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{key}={value!r} is invalid: it counts {_COUNTS[key]} (valid: an integer >= 1)")
    where = f"for parallel.pipeline_schedule={name} with mesh.pipeline={stages}"
    if name in ("gpipe", "1f1b") and virtual != 1:
        raise ConfigError(f"parallel.virtual_stages={virtual} is invalid for parallel.pipeline_schedule={name}: "
                          f"only interleaved_1f1b runs several chunks per stage (valid: 1)")
    if name == "1f1b" and microbatches < stages:
        raise ConfigError(f"parallel.pipeline_microbatches={microbatches} is invalid {where}: 1F1B needs at least "
                          f"as many microbatches as stages (valid: >= {stages})")
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
    last_chunk = p * v - 1
    done: dict[Op, tuple[int, int]] = {}  # op -> (tick, stage)
    in_flight, peak, busy = [0] * p, [0] * p, [0] * p
    transfers: list[Transfer] = []
    for tick, row in enumerate(schedule.ticks):
        if len(row) != p:
            raise ConfigError(f"schedule {schedule.name!r}: tick {tick} has {len(row)} entries, one per stage "
                              f"expected (valid: {p})")
        for stage, op in enumerate(row):
            if op is None:
                continue
            _check_op(schedule, tick, stage, op, done)
            done[op] = (tick, stage)
            busy[stage] += 1
            in_flight[stage] += 1 if op.kind == FORWARD else -1
            transfers.extend(_sends(op, tick, p, last_chunk))
        peak = [max(a, b) for a, b in zip(peak, in_flight, strict=False)]  # counted at the end of each tick
    missing = [op for op in _all_ops(p, m, v) if op not in done]
    if missing:
        listed = ", ".join(f"{_label(op)} on stage {op.chunk % p}" for op in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ConfigError(f"schedule {schedule.name!r} never runs {listed}{more}: every forward and backward of "
                          f"each of {m} microbatches on each of {p * v} chunks must run exactly once")
    slots = p * schedule.num_ticks
    return ScheduleStats(num_ticks=schedule.num_ticks, bubble_fraction=(slots - sum(busy)) / slots,
                         peak_in_flight=tuple(peak), transfers=tuple(transfers), busy_ticks=tuple(busy))


def _check_op(schedule: Schedule, tick: int, stage: int, op: object, done: dict[Op, tuple[int, int]]) -> None:
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual
    where = f"schedule {schedule.name!r}, tick {tick}, stage {stage}"
    if (not isinstance(op, tuple) or len(op) != 3 or op[0] not in (FORWARD, BACKWARD)
            or not all(isinstance(x, int) for x in op[1:])):
        raise ConfigError(f"{where}: {op!r} is not an op (valid: Op(kind='F' or 'B', microbatch, chunk) or None)")
    op = Op(*op)
    if not 0 <= op.microbatch < m or not 0 <= op.chunk < p * v:
        raise ConfigError(f"{where}: {_label(op)} is out of range (valid: microbatch 0..{m - 1}, "
                          f"chunk 0..{p * v - 1})")
    if op.chunk % p != stage:
        raise ConfigError(f"{where}: {_label(op)} is on the wrong stage: chunk {op.chunk} runs on stage "
                          f"{op.chunk % p} (chunk % {p})")
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


def _sends(op: Op, tick: int, p: int, last_chunk: int) -> list[Transfer]:
    """What `op` sends to the stage of its consumer (listed even when that is the same stage)."""
    if op.kind == FORWARD and op.chunk < last_chunk:
        return [Transfer(tick, op.chunk % p, (op.chunk + 1) % p, "activation", op.microbatch, op.chunk)]
    if op.kind == BACKWARD and op.chunk > 0:
        return [Transfer(tick, op.chunk % p, (op.chunk - 1) % p, "gradient", op.microbatch, op.chunk)]
    return []


def _all_ops(p: int, m: int, v: int) -> list[Op]:
    return [Op(kind, i, c) for kind in (FORWARD, BACKWARD) for c in range(p * v) for i in range(m)]


def _label(op: Op) -> str:
    return f"{op.kind}(microbatch={op.microbatch}, chunk={op.chunk})"


# ---------------------------------------------------------------------------------------------
# Rendering


def render_timeline(schedule: Schedule) -> str:
    """The table as text: one row per stage, one column per tick; "F3" (or "F3.5": microbatch 3, chunk 5), "." idle."""
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
    if par.pipeline_schedule != "interleaved_1f1b" and v != 1:
        raise ConfigError(f"parallel.virtual_stages={v} is invalid for parallel.pipeline_schedule="
                          f"{par.pipeline_schedule} (valid: 1; use interleaved_1f1b for virtual stages)")
    if par.pipeline_schedule == "interleaved_1f1b" and v < 2:
        raise ConfigError(f"parallel.virtual_stages={v} is invalid for interleaved_1f1b (valid: >= 2)")
    if m.num_layers % (p * v):
        preset = "" if m.preset is None else f", not preset {m.preset!r} as is"
        raise ConfigError(
            f"model.num_layers={m.num_layers} is not divisible by mesh.pipeline={p} x parallel.virtual_stages={v} "
            f"= {p * v}: every stage{' chunk' if v > 1 else ''} gets the same number of layers "
            f"(valid: a model with a multiple of {p * v} layers{preset}, "
            f"or mesh.pipeline x virtual_stages in {divisors(m.num_layers)})"
        )
    micro = resolved_microbatches(cfg, p, rows)
    if micro < 1 or rows % micro:
        raise ConfigError(
            f"parallel.pipeline_microbatches={micro} does not divide the {rows} rows each device gets per step "
            f"(train.global_batch_size={t.global_batch_size} / train.grad_accum={t.grad_accum} / batch axes): "
            f"microbatches must be equal (valid: a divisor of {rows}: {divisors(rows)})"
        )
    build_schedule(par.pipeline_schedule, p, micro, v)
    if m.moe is not None:
        raise ConfigError(f"model.moe (every={m.moe.every}) with mesh.pipeline={p}: MoE layers inside pipeline "
                          "stages are not supported yet (valid: mesh.pipeline=1 for MoE models, or model.moe=null)")


def resolved_microbatches(cfg: Config, stages: int, rows: int) -> int:
    """parallel.pipeline_microbatches, or by default the largest of 4p, 2p, p that divides a device's rows per step."""
    if cfg.parallel.pipeline_microbatches is not None:
        return cfg.parallel.pipeline_microbatches
    for m in (4 * stages, 2 * stages):
        if rows % m == 0:
            return m
    return stages

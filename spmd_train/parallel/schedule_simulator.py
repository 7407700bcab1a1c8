"""The schedule simulator: checks a tick table (`schedules.Schedule`) against the timing model, measures it, draws it.

Validation names the tick, stage and op that break the timing model of `schedules`; measurement counts ticks,
bubble, activations held and stage-to-stage transfers.

Cost model (`ScheduleStats.*_units`): F = B = W = 1 time unit for split schedules, fused B = 2
(= B + W) elsewhere, so a microbatch-chunk costs 3 units in every schedule; a unit is the forward
time of one chunk (1/virtual of a stage's layers).
"""

from __future__ import annotations

from dataclasses import dataclass

from spmd_train.errors import ConfigError
from spmd_train.parallel.schedules import BACKWARD, FORWARD, WEIGHT, Op, Schedule, op_inputs


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
            start = max([free[stage], *(finish[dep] for dep in op_inputs(op, last_chunk))])
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
    for dep in op_inputs(op, p * v - 1):
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

"""Pipeline schedules as data: which stage runs which forward/backward op at each tick.

Pure Python (no jax). Each schedule registers an op order per stage (`parallel.pipeline_schedules`: GPipe, 1F1B,
interleaved 1F1B, the zero-bubble orders) and its facts (`config.schedule_facts`); `build_schedule` list-schedules
the orders under one timing model (an op takes one tick; its output is usable from the next tick on);
`schedule_simulator.simulate` checks the resulting tables.

Derivation: docs/explanation/pipeline-executor.md#schedules-as-data
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from spmd_train.config.schedule_facts import schedule_facts
from spmd_train.config.validity import refuse, schedule_request
from spmd_train.parallel.pipeline_schedules import schedule_order

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
        return schedule_facts(self.name).split_backward

    @property
    def placement(self) -> str:
        """Where chunks live: "loop" (chunk c on stage c % stages) or "v" (chunks d and 2p-1-d on stage d)."""
        return placement_of(self.name)

    def stage_of(self, chunk: int) -> int:
        """The stage that runs `chunk`."""
        return stage_of(chunk, self.stages, self.placement)


def placement_of(name: str) -> str:
    """The chunk placement of schedule `name` (`ScheduleFacts.placement`): "v" for zb_v, else "loop"."""
    return schedule_facts(name).placement


def stage_of(chunk: int, stages: int, placement: str) -> int:
    """The stage holding `chunk` under `placement` ("loop": chunk % stages; "v": chunk, then back up)."""
    if placement == "v":
        return chunk if chunk < stages else 2 * stages - 1 - chunk
    return chunk % stages


def build_schedule(name: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The tick table of schedule `name` for `stages` stages, `microbatches` microbatches, `virtual` chunks/stage."""
    refuse(schedule_request(name, stages, microbatches, virtual))
    p, m, v = stages, microbatches, virtual
    last = p * v - 1
    orders = schedule_order(name).orders(p, m, v, lambda op: op_inputs(Op(*op), last))
    ticks = _list_schedule([[Op(*op) for op in order] for order in orders], last_chunk=last)
    return Schedule(name=name, stages=p, microbatches=m, virtual=v, ticks=ticks)


def _list_schedule(orders: Sequence[Sequence[Op]], last_chunk: int) -> tuple[tuple[Op | None, ...], ...]:
    """Tick by tick, each stage runs its next op in order once that op's inputs exist, else idles."""
    done: dict[Op, int] = {}
    position = [0] * len(orders)
    ticks: list[tuple[Op | None, ...]] = []
    while any(pos < len(order) for pos, order in zip(position, orders, strict=False)):
        tick = len(ticks)
        nexts = [order[pos] if pos < len(order) else None for pos, order in zip(position, orders, strict=False)]
        row = tuple(op if op is not None and all(done.get(dep, tick) < tick for dep in op_inputs(op, last_chunk))
                    else None for op in nexts)
        if not any(row):  # cannot happen for the orders above; guards against an order that deadlocks
            raise RuntimeError(f"pipeline op orders deadlock at tick {tick}: next ops {nexts}")
        for s, op in enumerate(row):
            if op is not None:
                done[op] = tick
                position[s] += 1
        ticks.append(row)
    return tuple(ticks)


def op_inputs(op: Op, last_chunk: int) -> tuple[Op, ...]:
    """The ops whose outputs `op` consumes (they must run at earlier ticks; `last_chunk`: stages x virtual - 1)."""
    if op.kind == WEIGHT:
        return (Op(BACKWARD, op.microbatch, op.chunk),)
    if op.kind == FORWARD:
        return (Op(FORWARD, op.microbatch, op.chunk - 1),) if op.chunk > 0 else ()
    if op.chunk == last_chunk:
        return (Op(FORWARD, op.microbatch, op.chunk),)
    return Op(FORWARD, op.microbatch, op.chunk), Op(BACKWARD, op.microbatch, op.chunk + 1)

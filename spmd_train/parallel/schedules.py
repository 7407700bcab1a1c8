"""Pipeline schedules as data: which stage runs which forward/backward op at each tick.

Pure Python (no jax): the pipeline executor consumes these tables, and `schedule_simulator.simulate`
checks a table against the timing model before anyone trusts it.

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
counts equal the closed-form bubbles. Which requests are valid is `config.validity.schedule_request`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from spmd_train.config.validity import SCHEDULES, SPLIT_BACKWARD, refuse, schedule_request
from spmd_train.parallel.zero_bubble import zb_h1_orders, zb_v_orders

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


def build_schedule(name: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The tick table of schedule `name` for `stages` stages, `microbatches` microbatches, `virtual` chunks/stage."""
    refuse(schedule_request(name, stages, microbatches, virtual))
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
        orders = [[Op(*op) for op in order] for order in zb_v_orders(p, m, lambda op: op_inputs(Op(*op), 2 * p - 1))]
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

"""From a schedule table to the per-tick, per-stage integer program the executor runs.

The executor is one SPMD program: at every tick each stage reads a row of small integers
(what to do, on which microbatch and chunk, which buffer slots to read and write) indexed
by its position on the `pipeline` axis. This module derives those rows from a validated
`Schedule` and sizes the buffers by interval allocation, so a stage holds exactly as many
activations, cotangents and saved residuals as the schedule keeps alive at once.

Timing (the schedule module's contract): an op's output is sent during the tick that made
it (`ppermute` at the end of the tick) and stored into a receive slot, so it can be read
from the next tick on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spmd_train.errors import ConfigError
from spmd_train.parallel.schedules import FORWARD, SCHEDULES, Schedule, simulate

IDLE_CODE, FORWARD_CODE, BACKWARD_CODE = 0, 1, 2
"""A plan row's `kind` column: the integer index of the executor's `lax.switch` branch (the schedule
table names the same ops "F" and "B")."""

FIELDS = ("kind", "microbatch", "chunk", "read", "stash", "write_ct", "recv_act", "recv_ct")
"""Columns of a plan row. `chunk` is the local chunk index (global chunk // stages). `read`:
the activation slot a forward reads (-1: the microbatch's embedded input) or the cotangent
slot a backward reads. `stash`: the residual slot a forward fills and its backward empties.
`write_ct`: on the last chunk, the cotangent slot a forward fills with d(loss)/d(output).
`recv_act` / `recv_ct`: where this tick's incoming activation / cotangent is stored (the
spare slot, one past the real ones, when nothing useful arrives)."""


@dataclass(frozen=True)
class PipelinePlan:
    """The executor's program: `rows[t, s]` holds FIELDS for stage s at tick t."""

    rows: np.ndarray  # int32 [ticks, stages, len(FIELDS)]
    act_slots: int
    ct_slots: int
    stash_slots: int
    schedule: Schedule

    @property
    def num_ticks(self) -> int:
        """Ticks the executor runs (equal to the schedule's)."""
        return int(self.rows.shape[0])


class _Slots:
    """Greedy interval allocation of buffer slots per stage."""

    def __init__(self, stages: int):
        self.free_at: list[list[int]] = [[] for _ in range(stages)]  # per slot: tick after which it is free

    def take(self, stage: int, start: int, end: int) -> int:
        """A slot written at tick `start` and last read at tick `end` (>= start)."""
        slots = self.free_at[stage]
        for i, free in enumerate(slots):
            if free <= start:
                slots[i] = end
                return i
        slots.append(end)
        return len(slots) - 1

    @property
    def count(self) -> int:
        return max((len(s) for s in self.free_at), default=0)


def build_plan(schedule: Schedule) -> PipelinePlan:
    """Validate the schedule and compile it into buffer-slot assignments per tick and stage."""
    if schedule.split_backward or schedule.placement != "loop":
        # Its rows would need W ops, a slot for what W reads and V-placed chunks: refused, not mis-run.
        raise ConfigError(f"parallel.pipeline_schedule={schedule.name} is simulated only: the executor runs "
                          f"{', '.join(SCHEDULES)} (valid: one of those)")
    simulate(schedule)  # raises on an invalid table
    p, last = schedule.stages, schedule.stages * schedule.virtual - 1
    when: dict[tuple[str, int, int], int] = {}
    for t, row in enumerate(schedule.ticks):
        for op in row:
            if op is not None:
                when[(op.kind, op.microbatch, op.chunk)] = t

    ticks = schedule.num_ticks
    rows = np.zeros((ticks, p, len(FIELDS)), np.int32)
    col = {name: i for i, name in enumerate(FIELDS)}
    acts, cts, stash = _Slots(p), _Slots(p), _Slots(p)
    recv_act: dict[tuple[int, int], int] = {}  # (tick, receiving stage) -> slot
    recv_ct: dict[tuple[int, int], int] = {}
    read: dict[tuple[str, int, int], int] = {}
    stash_of: dict[tuple[int, int], int] = {}
    write_ct: dict[tuple[int, int], int] = {}

    # Allocate in tick order so slots are reused as soon as they are free.
    for t, row in enumerate(schedule.ticks):
        for s, op in enumerate(row):
            if op is None:
                continue
            mb, c = op.microbatch, op.chunk
            if op.kind == "F":
                stash_of[(mb, c)] = stash.take(s, t, when[("B", mb, c)])
                if c < last:
                    dst = (c + 1) % p
                    slot = acts.take(dst, t, when[("F", mb, c + 1)])
                    recv_act[(t, dst)] = slot
                    read[("F", mb, c + 1)] = slot
                else:
                    slot = cts.take(s, t, when[("B", mb, c)])
                    write_ct[(mb, c)] = slot
                    read[("B", mb, c)] = slot
            elif c > 0:
                dst = (c - 1) % p
                slot = cts.take(dst, t, when[("B", mb, c - 1)])
                recv_ct[(t, dst)] = slot
                read[("B", mb, c - 1)] = slot

    act_slots, ct_slots, stash_slots = max(acts.count, 1), max(cts.count, 1), max(stash.count, 1)
    for t, row in enumerate(schedule.ticks):
        for s in range(p):
            r = rows[t, s]
            r[col["recv_act"]] = recv_act.get((t, s), act_slots)  # the spare slot absorbs the bubble's sends
            r[col["recv_ct"]] = recv_ct.get((t, s), ct_slots)
            r[col["write_ct"]] = ct_slots
            r[col["read"]] = -1
            op = row[s]
            if op is None:
                continue
            mb, c = op.microbatch, op.chunk
            r[col["kind"]] = FORWARD_CODE if op.kind == FORWARD else BACKWARD_CODE
            r[col["microbatch"]] = mb
            r[col["chunk"]] = c // p
            r[col["stash"]] = stash_of[(mb, c)]
            if op.kind == "F":
                r[col["read"]] = read.get(("F", mb, c), -1)
                r[col["write_ct"]] = write_ct.get((mb, c), ct_slots)
            else:
                r[col["read"]] = read[("B", mb, c)]
    return PipelinePlan(rows=rows, act_slots=act_slots, ct_slots=ct_slots, stash_slots=stash_slots, schedule=schedule)

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

from spmd_train.parallel.schedule_simulator import simulate
from spmd_train.parallel.schedules import BACKWARD, FORWARD, WEIGHT, Schedule

IDLE_CODE, FORWARD_CODE, BACKWARD_CODE, WEIGHT_CODE = 0, 1, 2, 3
"""A plan row's `kind` column: the integer index of the executor's `lax.switch` branch (the schedule
table names the same ops "F", "B" and "W"). In a split-backward plan code 2 is B, the input gradient
only, and code 3 is W."""

FIELDS = ("kind", "microbatch", "chunk", "read", "stash", "write_ct", "recv_act", "recv_ct")
"""Columns of a plan row. `chunk` is the local chunk index (global chunk // stages). `read`:
the activation slot a forward reads (-1: the microbatch's embedded input) or the cotangent
slot a backward reads. `stash`: the residual slot a forward fills and its backward empties.
`write_ct`: on the last chunk, the cotangent slot a forward fills with d(loss)/d(output).
`recv_act` / `recv_ct`: where this tick's incoming activation / cotangent is stored (the
spare slot, one past the real ones, when nothing useful arrives)."""

SPLIT_FIELDS = ("kind", "microbatch", "chunk", "model_chunk", "read", "stash", "saved", "recv_down", "recv_up",
                "keep")
"""Columns of a split-backward (zb_h1, zb_v) plan row. Activations and cotangents share one buffer of
`act_slots` slots (+ the spare) there, because under the V placement either kind may arrive from either
neighbour. `chunk`: the local chunk index (global chunk // stages under both placements: under "v"
chunks 0..p-1 are local chunk 0, p..2p-1 local chunk 1); `model_chunk`: the global one. `read`: the
buffer slot F reads (-1: the embedded input) or B reads (its cotangent). `stash`: the residual slot F
fills, which B and W read and which lives until W. `saved`: the slot B fills with what W needs and W
reads. Each tick the op's output (F: y, or on the last chunk d(loss)/dy; B: dx) goes to the stage
below (`ppermute` i -> i+1, stored at that stage's `recv_down`), to the stage above (i -> i-1,
`recv_up`) or stays on this stage (`keep`: the V's chunk p-1 -> p hand-off and the last chunk's
cotangent); the spare slot absorbs every copy nobody needs."""


@dataclass(frozen=True)
class PipelinePlan:
    """The executor's program: `rows[t, s]` holds FIELDS for stage s at tick t."""

    rows: np.ndarray  # int32 [ticks, stages, len(FIELDS)]
    act_slots: int
    ct_slots: int
    stash_slots: int
    schedule: Schedule
    saved_slots: int = 0  # split-backward plans: slots for what B hands to W
    fields: tuple[str, ...] = FIELDS  # the columns of `rows`: FIELDS, or SPLIT_FIELDS for split-backward plans

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
    simulate(schedule)  # raises on an invalid table
    if schedule.split_backward:
        return _build_split_plan(schedule)
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


def _op_ticks(schedule: Schedule) -> dict[tuple[str, int, int], int]:
    return {(op.kind, op.microbatch, op.chunk): t for t, row in enumerate(schedule.ticks) for op in row
            if op is not None}


def _consumer(schedule: Schedule, kind: str, mb: int, c: int) -> tuple[str, int, int] | None:
    """The op that reads the output of op (kind, mb, c): F feeds the next chunk's F (the last chunk's
    cotangent feeds its own B), B feeds the previous chunk's B; W and chunk 0's B feed no op."""
    last = schedule.stages * schedule.virtual - 1
    if kind == FORWARD:
        return (FORWARD, mb, c + 1) if c < last else (BACKWARD, mb, c)
    if kind == BACKWARD and c > 0:
        return (BACKWARD, mb, c - 1)
    return None


def _build_split_plan(schedule: Schedule) -> PipelinePlan:
    """Rows of a split-backward schedule (SPLIT_FIELDS): slots for the one value buffer, stashes and saved."""
    p = schedule.stages
    when = _op_ticks(schedule)
    col = {name: i for i, name in enumerate(SPLIT_FIELDS)}
    bufs, stash, saved = _Slots(p), _Slots(p), _Slots(p)
    recv: dict[tuple[int, int, str], int] = {}  # (tick, receiving stage, column) -> slot
    read: dict[tuple[str, int, int], int] = {}
    stash_of: dict[tuple[int, int], int] = {}
    saved_of: dict[tuple[int, int], int] = {}
    for t, row in enumerate(schedule.ticks):  # in tick order, so slots are reused as soon as they are free
        for s, op in enumerate(row):
            if op is None:
                continue
            mb, c = op.microbatch, op.chunk
            if op.kind == FORWARD:
                # Simplest correct lifetime: the whole stash until W, though B frees what only it reads.
                stash_of[(mb, c)] = stash.take(s, t, when[(WEIGHT, mb, c)])
            elif op.kind == BACKWARD:
                saved_of[(mb, c)] = saved.take(s, t, when[(WEIGHT, mb, c)])
            consumer = _consumer(schedule, op.kind, mb, c)
            if consumer is None:
                continue
            dst = schedule.stage_of(consumer[2])
            slot = bufs.take(dst, t, when[consumer])
            read[consumer] = slot
            # At p == 2 both rings reach the other stage: the down ring is taken, the up copy is spare.
            column = "keep" if dst == s else "recv_down" if dst == (s + 1) % p else "recv_up"
            recv[(t, dst, column)] = slot

    buf_slots, stash_slots, saved_slots = max(bufs.count, 1), max(stash.count, 1), max(saved.count, 1)
    rows = np.zeros((schedule.num_ticks, p, len(SPLIT_FIELDS)), np.int32)
    codes = {FORWARD: FORWARD_CODE, BACKWARD: BACKWARD_CODE, WEIGHT: WEIGHT_CODE}
    for t, row in enumerate(schedule.ticks):
        for s in range(p):
            r = rows[t, s]
            for column in ("recv_down", "recv_up", "keep"):
                r[col[column]] = recv.get((t, s, column), buf_slots)  # the spare slot
            r[col["read"]] = -1
            op = row[s]
            if op is None:
                continue
            mb, c = op.microbatch, op.chunk
            r[col["kind"]], r[col["microbatch"]] = codes[op.kind], mb
            r[col["chunk"]], r[col["model_chunk"]] = c // p, c  # local index c // p under "loop" and "v" alike
            r[col["stash"]] = stash_of[(mb, c)]
            r[col["saved"]] = saved_of.get((mb, c), 0)  # F does not use it
            if op.kind != WEIGHT:
                r[col["read"]] = read.get((op.kind, mb, c), -1)
    return PipelinePlan(rows=rows, act_slots=buf_slots, ct_slots=0, stash_slots=stash_slots, schedule=schedule,
                        saved_slots=saved_slots, fields=SPLIT_FIELDS)

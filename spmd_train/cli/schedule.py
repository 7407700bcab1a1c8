"""`spmd-train schedule`: a pipeline schedule's timeline and figures as text (no config, no devices)."""

from __future__ import annotations

from fractions import Fraction

from spmd_train.config.schedule_facts import names_where, schedule_facts, schedule_names, spoken
from spmd_train.errors import ConfigError
from spmd_train.parallel.schedule_simulator import ScheduleStats, render_timeline, simulate
from spmd_train.parallel.schedules import build_schedule

MAX_CHUNKS = 16384
"""stages x microbatches x virtual this command draws: about 200 KB of timeline and a few seconds (the
simulator's cost grows with it; 4x that took minutes)."""


def schedule_report(name: str, stages: int, microbatches: int, virtual: int | None = None) -> str:
    """The timeline of schedule `name` and its figures; `virtual=None`: the fewest chunks it runs
    (`ScheduleFacts.min_virtual`: 2 for interleaved_1f1b and zb_v, else 1)."""
    if virtual is None:
        virtual = schedule_facts(name).min_virtual
    if stages * microbatches * virtual > MAX_CHUNKS:
        raise ConfigError(f"--stages {stages} x --microbatches {microbatches} x --virtual {virtual} = "
                          f"{stages * microbatches * virtual:,} microbatch-chunks is more than this command draws "
                          f"(valid: a product up to {MAX_CHUNKS:,})")
    schedule = build_schedule(name, stages, microbatches, virtual)
    stats = simulate(schedule)
    p, m, v = stages, microbatches, virtual
    activations = sum(t.kind == "activation" for t in stats.transfers)
    gradients = len(stats.transfers) - activations
    chunks = f", {v} chunks per stage" if v > 1 else ""
    ops = "F/B/W" if schedule.split_backward else "F/B"
    where = ("chunk c runs on stage c for c < stages, else 2*stages-1-c" if schedule.placement == "v"
             else "chunk c runs on stage c % stages")
    legend = f"{ops}<microbatch>.<chunk> ({where})" if v > 1 else f"{ops}<microbatch>"
    lines = [
        f"{name}: {p} stages, {m} microbatches{chunks}; {legend}, '.' idle",
        render_timeline(schedule),
        "",
        f"ticks:           {stats.num_ticks}" + (f" (each runs one chunk: 1/{v} of a stage's layers)" if v > 1 else ""),
        f"bubble fraction: {stats.bubble_fraction:.4f}{_tick_formula(name, p, m, v)}",
        f"peak in flight:  {_per_stage(stats.peak_in_flight)} (microbatch-chunks holding activations"
        + (", F until W)" if schedule.split_backward else ")"),
    ]
    if schedule.split_backward:
        lines.append(f"whole:           {_per_stage(stats.peak_whole_activations)} (F until B: B frees all but "
                     "what W needs)")
    lines += [
        f"busy ticks:      {_per_stage(stats.busy_ticks)}",
        f"transfers:       {activations} activation, {gradients} gradient",
        *_unit_lines(name, p, stats, schedule.split_backward),
    ]
    return "\n".join(lines)


def schedule_help() -> str:
    """--schedule's help: the registered schedules, the split-backward ones apart."""
    return (f"{', '.join(names_where(split_backward=False))}, or {' / '.join(names_where(split_backward=True))} "
            "(zero-bubble: split backward)")


def virtual_help() -> str:
    """--virtual's help: the default chunks per stage of each schedule that runs several."""
    several: dict[int, list[str]] = {}
    for name in schedule_names():
        if (low := schedule_facts(name).min_virtual) > 1:
            several.setdefault(low, []).append(name)
    defaults = "".join(f"{k} for {spoken(tuple(names))}, " for k, names in several.items())
    return f"model chunks per stage (default: {defaults}else 1)"


def _tick_formula(name: str, p: int, m: int, v: int) -> str:
    facts = schedule_facts(name)
    if not facts.bubble_exact:
        return ""
    if facts.split_backward:  # 3*v*m ops per stage, p-1 idle ticks
        ideal = Fraction(p - 1, 3 * v * m + p - 1)
        return f" (formula (p-1)/(3{'' if v == 1 else '*v*'}m+p-1) = {ideal} = {float(ideal):.4f})"
    # The bubble every fused schedule should reach: p-1 idle ticks before the first backward and
    # after it on each stage, against v*m ticks of forwards and as many of backwards.
    ideal = Fraction(p - 1, v * m + p - 1)
    return f" (formula (p-1)/(v*m+p-1) = {ideal} = {float(ideal):.4f})"


def _unit_lines(name: str, p: int, stats: ScheduleStats, split: bool) -> list[str]:
    costs = "F = B = W = 1" if split else "F = 1, B = 2 (input and weight gradients)"
    note = schedule_facts(name).unit_bubble.format(p1=p - 1, p3=3 * (p - 1))
    formula = f"; {note}" if note else ""
    return [
        f"time units:      {costs} (a unit: one chunk's forward)",
        f"async:           {stats.makespan_units} units; bubble per stage {_per_stage(stats.bubble_units)}{formula}",
        f"lockstep:        {stats.lockstep_units} units (each tick as long as its longest op), "
        f"bubble fraction {stats.lockstep_bubble_fraction:.4f}",
    ]


def _per_stage(values: tuple[int, ...]) -> str:
    return ", ".join(f"stage {s}: {n}" for s, n in enumerate(values))

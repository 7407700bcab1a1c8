"""`spmd-train schedule`: a pipeline schedule's timeline and figures as text (no config, no devices)."""

from __future__ import annotations

from fractions import Fraction

from spmd_train.errors import ConfigError
from spmd_train.parallel.schedules import build_schedule, render_timeline, simulate

MAX_CHUNKS = 16384
"""stages x microbatches x virtual this command draws: about 200 KB of timeline and a few seconds (the
simulator's cost grows with it; 4x that took minutes)."""


def schedule_report(name: str, stages: int, microbatches: int, virtual: int | None = None) -> str:
    """The timeline of schedule `name` followed by its figures; `virtual=None` means 2 for interleaved_1f1b, else 1."""
    if virtual is None:
        virtual = 2 if name == "interleaved_1f1b" else 1
    if stages * microbatches * virtual > MAX_CHUNKS:
        raise ConfigError(f"--stages {stages} x --microbatches {microbatches} x --virtual {virtual} = "
                          f"{stages * microbatches * virtual:,} microbatch-chunks is more than this command draws "
                          f"(valid: a product up to {MAX_CHUNKS:,})")
    schedule = build_schedule(name, stages, microbatches, virtual)
    stats = simulate(schedule)
    p, m, v = stages, microbatches, virtual
    # The bubble every one of these schedules should reach: p-1 idle ticks before the first
    # backward and after it on each stage, against v*m ticks of forwards and as many of backwards.
    ideal = Fraction(p - 1, v * m + p - 1)
    activations = sum(t.kind == "activation" for t in stats.transfers)
    gradients = len(stats.transfers) - activations
    chunks = f", {v} chunks per stage" if v > 1 else ""
    legend = ("F<microbatch>.<chunk> / B<microbatch>.<chunk> (chunk c runs on stage c % stages)" if v > 1
              else "F<microbatch> / B<microbatch>")
    return "\n".join([
        f"{name}: {p} stages, {m} microbatches{chunks}; {legend}, '.' idle",
        render_timeline(schedule),
        "",
        f"ticks:           {stats.num_ticks}" + (f" (each runs one chunk: 1/{v} of a stage's layers)" if v > 1 else ""),
        f"bubble fraction: {stats.bubble_fraction:.4f} (formula (p-1)/(v*m+p-1) = {ideal} = {float(ideal):.4f})",
        f"peak in flight:  {_per_stage(stats.peak_in_flight)} (microbatch-chunks holding activations)",
        f"busy ticks:      {_per_stage(stats.busy_ticks)}",
        f"transfers:       {activations} activation, {gradients} gradient",
    ])


def _per_stage(values: tuple[int, ...]) -> str:
    return ", ".join(f"stage {s}: {n}" for s, n in enumerate(values))

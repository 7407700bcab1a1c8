"""Write a benchmark's table into its own section of docs/benchmarks.md, with provenance."""

from __future__ import annotations

import datetime
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
HEADER = ("# Benchmarks\n\nEach section is written by the script it names; rerun the command with `--record` to "
          "refresh it.\n")
RECORD = "--record" in sys.argv[1:]
"""Whether this run writes its section of docs/benchmarks.md: only when asked (`--record`), so a trial or an
abridged run (fewer rounds, one case) never replaces the recorded figures. Taken out of sys.argv here, before the
script's own parser reads it."""
if RECORD:
    sys.argv.remove("--record")


def provenance(command: str) -> str:
    """Hardware, software versions, date and the exact command, as a markdown list."""
    dev = jax.devices()[0]
    return (
        f"- command: `{command}`\n"
        f"- date: {datetime.date.today().isoformat()}\n"
        f"- hardware: {len(jax.devices())} x {dev.device_kind} ({dev.platform}); host {platform.machine()}, "
        f"{_cpu_count()} cores\n"
        f"- jax {jax.__version__}{_libtpu()}, python {platform.python_version()}\n"
    )


def _libtpu() -> str:
    """', libtpu X' where libtpu is installed: TPU compile times (describe --topology) depend on its build."""
    from importlib import metadata

    try:
        return f", libtpu {metadata.version('libtpu')}"
    except metadata.PackageNotFoundError:
        return ""


def update_section(name: str, title: str, body: str) -> None:
    """Replace (or append) the section `name` of docs/benchmarks.md with `--record`; print it otherwise."""
    if not RECORD:
        print(f"## {title}\n\n{body.rstrip()}\n")
        print(f"(not recorded: rerun with --record to write it into {DOC.name})", file=sys.stderr)
        return
    text = DOC.read_text() if DOC.exists() else HEADER
    block = f"<!-- {name}:start -->\n## {title}\n\n{body.rstrip()}\n<!-- {name}:end -->"
    pattern = re.compile(rf"<!-- {name}:start -->.*?<!-- {name}:end -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)
    print(f"updated {DOC} section {name!r}", file=sys.stderr)


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


@dataclass(frozen=True)
class TimedSteps:
    """One config's train step, compiled once and run `steps + 1` times (the first a warm-up)."""

    engine: Any
    compiled: Any
    compile_seconds: float
    seconds: list[float]
    """Each step's blocked wall time, the warm-up first."""
    losses: list[float]

    @property
    def step_seconds(self) -> float:
        """Median of the timed steps (the warm-up left out)."""
        return statistics.median(self.seconds[1:])


def timed_steps(cfg, steps: int) -> TimedSteps:
    """Build `cfg`'s engine, compile its train step on batch 0, and run it `steps + 1` times, each blocked."""
    from spmd_train import Engine
    from spmd_train.data import make_source

    engine = Engine.build(cfg)
    state = engine.init_state()
    tokens = make_source(cfg).batch(0, engine.batch_sharding)
    start = time.perf_counter()
    compiled = engine.train_step.lower(state, tokens).compile()
    compile_s = time.perf_counter() - start
    seconds, losses = [], []
    for _ in range(steps + 1):
        start = time.perf_counter()
        state, metrics = compiled(state, tokens)
        # One step in flight at a time: two XLA:CPU programs with collectives in flight can deadlock.
        jax.block_until_ready(metrics)
        seconds.append(time.perf_counter() - start)
        losses.append(float(metrics["loss"]))
    return TimedSteps(engine, compiled, compile_s, seconds, losses)


def time_call(fn, *args, repeats: int = 10) -> float:
    """Mean seconds per call of `fn(*args)` after one warm-up call, blocking on the results."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats

"""Write a benchmark's table into its own section of docs/benchmarks.md, with provenance."""

from __future__ import annotations

import datetime
import platform
import re
import sys
import time
from pathlib import Path

import jax

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
HEADER = "# Benchmarks\n\nEach section is written by the script it names; rerun the command to refresh it.\n"


def provenance(command: str) -> str:
    """Hardware, software versions, date and the exact command, as a markdown list."""
    dev = jax.devices()[0]
    return (
        f"- command: `{command}`\n"
        f"- date: {datetime.date.today().isoformat()}\n"
        f"- hardware: {len(jax.devices())} x {dev.device_kind} ({dev.platform}); host {platform.machine()}, "
        f"{_cpu_count()} cores\n"
        f"- jax {jax.__version__}, python {platform.python_version()}\n"
    )


def update_section(name: str, title: str, body: str) -> None:
    """Replace (or append) the section `name` of docs/benchmarks.md."""
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


def time_call(fn, *args, repeats: int = 10) -> float:
    """Mean seconds per call of `fn(*args)` after one warm-up call, blocking on the results."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats

"""Readable tables for `spmd-train describe` (rich)."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from spmd_train.analysis.report import StepReport


def human_bytes(n: float | None) -> str:
    """1536 -> '1.50 KiB'."""
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def render(report: StepReport, console: Console | None = None) -> None:
    """Print the report as a header and four tables."""
    console = console or Console(width=None if sys.stdout.isatty() else 140)
    where = f"TPU slice {report.topology}" if report.topology else "this host"
    mesh = " x ".join(f"{a}={s}" for a, s in report.mesh.items() if s > 1) or "1 device"
    console.print(f"[bold]{report.devices} x {report.device_kind}[/bold] on {where}; mesh {mesh}; "
                  f"{report.param_count:,} parameters; step compiled in {report.compile_seconds:.1f} s")

    params = Table(title="Parameters", title_justify="left")
    for col in ("name", "shape", "logical axes", "partition spec", "bytes / device"):
        params.add_column(col, justify="right" if col == "bytes / device" else "left")
    for row in report.params:
        spec = ", ".join("-" if e is None else "+".join(e) if isinstance(e, tuple) else e for e in row.spec)
        params.add_row(row.path, str(list(row.shape)), ", ".join(str(n) for n in row.logical), spec,
                       human_bytes(row.bytes_per_device))
    console.print(params)

    d = report.per_device
    memory = Table(title="Memory per device", title_justify="left")
    memory.add_column("what")
    memory.add_column("bytes", justify="right")
    for label, key in (("parameters (from shardings)", "param_bytes"), ("optimizer state", "opt_state_bytes"),
                       ("batch", "batch_bytes"), ("compiled: arguments", "argument_bytes"),
                       ("compiled: outputs", "output_bytes"), ("compiled: temporaries", "temp_bytes"),
                       ("compiled: aliased (donated)", "alias_bytes"), ("peak = arg + out + temp - alias", "peak_bytes")):
        memory.add_row(label, human_bytes(d[key]))
    fits = "unknown device" if report.fits is None else ("yes" if report.fits else "[red]NO[/red]")
    memory.add_row("device memory (HBM)", f"{human_bytes(report.hbm_bytes)}  fits: {fits}")
    console.print(memory)

    if d["flops"] is None:
        for note in report.notes:
            console.print(f"[red]{note}[/red]")
        return
    ratio = d["flops"] / d["model_flops"] if d["model_flops"] else float("nan")
    console.print(f"FLOPs per device per step: compiled program {d['flops']:.4g}, model {d['model_flops']:.4g} "
                  f"(ratio {ratio:.2f}); XLA cost analysis, loop bodies counted once: {d['xla_cost_flops']:.4g}")

    coll = Table(title="Collectives per step (bytes each device sends, bandwidth-optimal)", title_justify="left")
    for col in ("op", "mesh axes", "group", "count", "bytes / device"):
        coll.add_column(col, justify="left" if col in ("op", "mesh axes") else "right")
    for c in report.collectives:
        coll.add_row(c.op, ", ".join(c.axes), str(c.group_size), str(c.count), human_bytes(c.bytes))
    console.print(coll if report.collectives else "No collectives: every device computes alone.")
    for note in report.notes:
        console.print(f"[dim]note: {note}[/dim]")

"""Readable tables for `spmd-train describe` and `Trainer.describe()` (rich renderables; HTML in notebooks).

Reports are passed in as `StepReport`s (analysis/step_report.py), which import this module to render themselves.
"""

from __future__ import annotations

import io
import sys
from typing import Any

from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from spmd_train.analysis.plan.comm import CommTerm
from spmd_train.analysis.plan.memory import MemoryEstimate
from spmd_train.analysis.plan.model import MEMORY_PARTS, analysis_lines
from spmd_train.config.schedule_facts import names_where, schedule_facts, spoken
from spmd_train.parallel import Backends
from spmd_train.units import human_bytes

PIPELINE_FLOPS_NOTE = (
    "pipelined step: FLOPs per device are the model count (averaged over devices; the last stage also runs the "
    "LM head), not the compiled program's: its loop-aware count adds both the forward and the backward branch of "
    "the per-tick lax.switch on every tick, though each tick runs at most one (pipeline.compiled_flops_all_branches)"
)
"""Said by the pipelined FLOPs line itself, so not repeated among the notes."""


class Rendered:
    """What `describe` returns shows itself as the CLI's tables: `rich.print(report)`, and HTML in a notebook."""

    def __rich_console__(self, console: Console, options: Any) -> Any:
        yield from renderables(self)

    def _repr_html_(self) -> str:
        return as_html(self)


def render(report: Any, console: Console | None = None) -> None:
    """Print the report as a header and its tables (parameters, memory, pipeline, experts, collectives)."""
    console = console or Console(width=None if sys.stdout.isatty() else 140)
    for item in renderables(report):
        console.print(item)


def as_html(report: Any) -> str:
    """The report's tables as one HTML fragment (what a notebook shows for `trainer.describe()`)."""
    console = Console(record=True, file=io.StringIO(), width=140, force_jupyter=False)
    render(report, console)
    return console.export_html(inline_styles=True, code_format='<pre style="font-family:monospace">{code}</pre>')


def renderables(report: Any) -> list[RenderableType]:
    """The report as rich renderables: header lines, then the tables, in the order `render` prints them."""
    out: list[RenderableType] = []
    where = f"TPU slice {report.topology}" if report.topology else "this host"
    mesh = " x ".join(f"{a}={s}" for a, s in report.mesh.items() if s > 1) or "1 device"
    out.append(f"[bold]{report.devices} x {report.device_kind}[/bold] on {where}; mesh {mesh}; "
               f"{report.param_count:,} parameters; step compiled in {report.compile_seconds:.1f} s")
    backends = report.resolved.get("backends")
    if backends:
        out.append("backends: " + Backends(**backends).describe())
    precision = report.resolved.get("precision")
    if precision:
        out.append(precision_line(precision))

    params = Table(title="Parameters", title_justify="left")
    for col in ("name", "shape", "logical axes", "partition spec", "bytes / device"):
        params.add_column(col, justify="right" if col == "bytes / device" else "left")
    for row in report.params:
        spec = ", ".join("-" if e is None else "+".join(e) if isinstance(e, tuple) else e for e in row.spec)
        params.add_row(row.path, str(list(row.shape)), ", ".join(str(n) for n in row.logical), spec,
                       human_bytes(row.bytes_per_device))
    out.append(params)

    d = report.per_device
    memory = Table(title="Memory per device", title_justify="left")
    memory.add_column("what")
    memory.add_column("bytes", justify="right")
    for label, key in (("parameters (from shardings)", "param_bytes"), ("optimizer state", "opt_state_bytes"),
                       ("batch", "batch_bytes"), ("compiled: arguments", "argument_bytes"),
                       ("compiled: outputs", "output_bytes"), ("compiled: temporaries", "temp_bytes"),
                       ("compiled: aliased (donated)", "alias_bytes"),
                       ("peak = arg + out + temp - alias", "peak_bytes")):
        memory.add_row(label, human_bytes(d[key]))
    if d.get("host_state_bytes") or d.get("host_param_bytes"):
        memory.add_row("optimizer state in host memory (offload)", human_bytes(d["host_state_bytes"]))
        if d.get("host_param_bytes"):
            memory.add_row("layer stack's parameters in host memory", human_bytes(d["host_param_bytes"]))
        memory.add_row("compiled: host arguments, host temporaries",
                       f"{human_bytes(d['host_argument_bytes'])}, {human_bytes(d['host_temp_bytes'])}")
        seconds = d.get("host_transfer_seconds")
        memory.add_row("host link per step (in and out)", f"{human_bytes(d['host_transfer_bytes'])}"
                       + (f", {seconds * 1e3:.0f} ms at the device's host link" if seconds else
                          ", time unknown (no host link figure for this device)"))
    fits = "unknown device" if report.fits is None else ("yes" if report.fits else "[red]NO[/red]")
    memory.add_row("device memory (HBM)", f"{human_bytes(report.hbm_bytes)}  fits: {fits}")
    out.append(memory)
    if report.analytic is not None:
        out.extend(analytic_renderables(report.analytic))
    if report.pipeline is not None:
        out.extend(pipeline_renderables(report.pipeline))
    if report.moe is not None:
        out.extend(moe_renderables(report.moe))
    if report.context is not None:
        out.extend(context_renderables(report.context))

    if d["flops"] is None:
        for note in report.notes:
            out.append(f"[red]{note}[/red]")
        return out
    if report.pipeline is not None:
        out.append(f"FLOPs per device per step (pipelined): model {d['model_flops']:.4g}, mean over devices; "
                   f"compiled program with both branches of every tick counted (an over-count) "
                   f"{report.pipeline.compiled_flops_all_branches:.4g}")
    else:
        ratio = d["flops"] / d["model_flops"] if d["model_flops"] else float("nan")
        out.append(f"FLOPs per device per step: compiled program {d['flops']:.4g}, model {d['model_flops']:.4g} "
                   f"(ratio {ratio:.2f}); XLA cost analysis, loop bodies counted once: {d['xla_cost_flops']:.4g}")
        if d.get("attention_flops"):
            att, model_att = d["attention_flops"], d["model_attention_flops"]
            out.append(f"  of which attention in our kernels: compiled {att:.4g}, model {model_att:.4g} (ratio "
                       f"{att / model_att:.2f}: remat recomputes the forward kernel, and the kernels compute the "
                       "blocks on the diagonal and at the window's edge whole)")

    coll = Table(title="Collectives per step (bytes each device sends, bandwidth-optimal)", title_justify="left")
    for col in ("op", "mesh axes", "group", "count", "bytes / device"):
        coll.add_column(col, justify="left" if col in ("op", "mesh axes") else "right")
    for c in report.collectives:
        coll.add_row(c.op, ", ".join(c.axes), str(c.group_size), str(c.count), human_bytes(c.bytes))
    out.append(coll if report.collectives else "No collectives: every device computes alone.")
    for row in report.floor_ratios():
        over = ("all of " if row.get("total") else "") + ", ".join(row["axes"])
        out.append(f"ZeRO floor over {over}: {human_bytes(row['floor_bytes'])} per device per "
                   f"step (weight gathers, gradient reductions); compiled {human_bytes(row['compiled_bytes'])} over "
                   f"those axes, ratio {row['ratio']:.2f}")
    for note in report.notes:
        if note != PIPELINE_FLOPS_NOTE:  # said in the FLOPs line already
            out.append(f"[dim]note: {note}[/dim]")
    if report.resolved.get("rules"):
        out.extend(rules_renderables(report.resolved["rules"]))
    return out


_MATMULS = {"fp8": "FP8 matmuls (e4m3 / e5m2)", "fp8-row": "FP8 matmuls (e4m3 / e5m2, per token / per channel)",
            "int8": "int8 matmuls (per token / per channel)"}


def precision_line(p: dict) -> str:
    """The precision policy in effect, in one line (`Engine.resolved()['precision']`)."""
    extras = [f"master copy {p['master']}" if p["master"] != "none" else "",
              f"loss scale {p['loss_scale']}" if p["loss_scale"] != "none" else "",
              _MATMULS.get(p["matmul"], ""),
              f"gradients summed in {p['reduce']}" if p.get("reduce", p["compute"]) != p["compute"] else ""]
    return (f"precision: parameters {p['params']}, compute {p['compute']}, optimizer moments {p['moments']}"
            + "".join(f", {e}" for e in extras if e))


def analytic_renderables(analytic: dict) -> list[RenderableType]:
    """The analytic model's figures for this layout, the lines `plan --explain` prints."""
    memory = MemoryEstimate(**{k: analytic["memory"][k] for k in MEMORY_PARTS})
    terms = [CommTerm(**t) for t in analytic["collectives"]]
    how = "as XLA:CPU partitions it" if analytic["xla_cpu"] else "as an accelerator's compiler partitions it"
    head = (f"Analytic estimate ({how}; `spmd-train plan --explain` prints the same for this layout): "
            f"peak {human_bytes(memory.peak)} per device")
    return [head, Text("\n".join(analysis_lines(memory, terms)))]


def render_rules(rules: dict, console: Console | None = None) -> None:
    """Print the effective rules (`ResolvedRules.to_json()`)."""
    console = console or Console(width=None if sys.stdout.isatty() else 140)
    for item in rules_renderables(rules):
        console.print(item)


def rules_renderables(rules: dict) -> list[RenderableType]:
    """The effective rules: one row per logical axis, then the rules the code added."""
    out: list[RenderableType] = []
    table = Table(title="Sharding rules (logical axis -> mesh axes)", title_justify="left")
    for col in ("logical axis", "activations", "parameters"):
        table.add_column(col)
    acts, params = rules["activations"], rules["params"]
    for name in [*acts, *(n for n in params if n not in acts)]:
        show = lambda axes: ", ".join(axes) if axes else "-" if axes is not None else ""
        table.add_row(name, show(acts.get(name)), show(params.get(name)))
    out.append(table)
    for line in rules["added_by_code"]:
        out.append(f"added by the code: {line}")
    return out



def pipeline_renderables(pipe: Any) -> list[RenderableType]:
    """The schedule's figures and, per stage, the VJP residuals (stash) it keeps alive at most."""
    out: list[RenderableType] = []
    virtual = f", {pipe.virtual_stages} chunks per stage" if pipe.virtual_stages > 1 else ""
    rows = f"{pipe.microbatch_rows} row{'s' if pipe.microbatch_rows != 1 else ''}"
    out.append(f"[bold]Pipeline schedule {pipe.schedule}[/bold]: {pipe.stages} stages, {pipe.microbatches} "
               f"microbatches of {rows} per device{virtual}; {pipe.ticks} ticks; bubble fraction "
               f"{pipe.bubble_fraction:.4f} ({_bubble_formula(pipe.schedule)} = {pipe.bubble_fraction_formula:.4f})")
    table = Table(title="Pipeline stages (stash: VJP residuals kept from a forward to its backward)",
                  title_justify="left")
    for col in ("stage", "busy ticks", "model FLOPs / device", "peak in flight (microbatch, chunk)", "stash at peak"):
        table.add_column(col, justify="right")
    for s in pipe.per_stage:
        table.add_row(str(s.stage), str(s.busy_ticks), f"{s.flops:.3e}", str(s.peak_in_flight),
                      human_bytes(s.stash_bytes))
    table.add_row("every device", "", "", f"{pipe.stash_slots} slots reserved", human_bytes(pipe.stash_bytes_reserved),
                  style="bold")
    out.append(table)
    if pipe.chunk_layers:
        out.append(_stage_balance(pipe))
    out.append(f"stash at peak = peak in flight x {human_bytes(pipe.stash_bytes_per_microbatch)} per (microbatch, "
               f"chunk); the compiled program is the same on every stage, so every device reserves the largest "
               f"stage's {pipe.stash_slots} slots (plus receive buffers of one microbatch activation each: "
               f"{_receive_buffers(pipe)})")
    return out



def _stage_balance(pipe) -> str:
    """How unequal the stages' FLOPs are (the last chunk's stage also runs the LM head); the split that evens them."""
    flops = [s.flops for s in pipe.per_stage]
    mean = sum(flops) / len(flops)
    layers = ", ".join(map(str, pipe.chunk_layers))
    where = "stage chunk" if pipe.virtual_stages > 1 else "stage"
    line = (f"layers per {where}: {layers} (the last with the LM head); slowest stage {max(flops) / mean:.3f}x the "
            "mean")
    if tuple(pipe.balanced_layers) == tuple(pipe.chunk_layers):
        return line + "; no split of whole layers is more even"
    return (line + f"; the most even split, {', '.join(map(str, pipe.balanced_layers))} layers, would make it "
            f"{max(pipe.balanced_flops) / mean:.3f}x (parallel.pipeline_layers=balanced"
            + (f", under a fused schedule: {spoken(names_where(split_backward=True))} run equal chunks)"
               if schedule_facts(pipe.schedule).split_backward else ")"))


def moe_renderables(moe: dict) -> list[RenderableType]:
    """Expert placement, capacity and the expected all-to-all traffic of the MoE layers."""
    out: list[RenderableType] = []
    table = Table(title="Mixture of experts", title_justify="left")
    table.add_column("what")
    table.add_column("value", justify="right")
    slots = "dropless (ragged)" if moe["capacity_slots"] is None else (
        f"{moe['capacity_slots']} per expert per group (capacity factor {moe['capacity_factor']})")
    if "devices_reached" in moe["all_to_all"]:
        slots = (f"{moe['all_to_all']['rows']} rows per group, one per token and device reached (at most "
                 f"{moe['all_to_all']['devices_reached']}; capacity factor {moe['capacity_factor']})")
    for label, value in (
        ("MoE layers (model layer index)", f"{moe['moe_layers']} ({', '.join(map(str, moe['layers']))})"
                                           + (f" + {moe['mtp_moe_layers']} in the MTP modules"
                                              if moe.get("mtp_moe_layers") else "")),
        ("experts, top-k, shared", f"{moe['num_experts']}, top-{moe['experts_per_token']}, "
                                   f"{moe['num_shared_experts']} shared"),
        ("experts per device (mesh.expert)", f"{moe['experts_per_device']} (expert={moe['expert_axis']})"),
        ("group (capacity counted over)", f"{moe['group_tokens']:,} tokens: {moe['group_rows']} rows per device, "
                                          f"{moe['groups']} groups"),
        ("slots", slots),
        ("all-to-all over expert per step", f"{moe['all_to_all']['count']} x, "
                                            f"{human_bytes(moe['all_to_all']['bytes_per_device'])} / device"),
    ):
        table.add_row(label, value)
    for p in moe["expert_params"]:
        spec = ", ".join("-" if e is None else "+".join(e) if isinstance(e, list) else e for e in p["spec"])
        table.add_row(f"split over expert: {p['path']}", spec)
    out.append(table)
    out.append(f"[dim]all-to-all bytes: {moe['all_to_all']['formula']}[/dim]")
    return out



def context_renderables(context: dict) -> list[RenderableType]:
    """Context-parallel attention: the scheme, the chunk layout, its `sequence` collectives predicted and compiled."""
    out: list[RenderableType] = []
    layout = (f"zigzag: chunks i and 2N-1-i of {2 * context['ways']}, {context['chunk_tokens']:,} tokens each"
              if context["layout"] == "zigzag" else f"contiguous: chunk i of {context['ways']}")
    out.append(f"Context parallelism: {context['implementation']} over sequence={context['ways']} "
               f"(local kernel {context['kernel']}); {context['tokens_per_device']:,} tokens per device, {layout}; "
               f"one device's K block {human_bytes(context['kv_block_bytes'])}")
    table = Table(title="Attention collectives over sequence per step", title_justify="left")
    for column in ("op", "predicted count", "compiled count", "predicted bytes / device", "compiled bytes / device"):
        table.add_column(column, justify="left" if column == "op" else "right")
    compiled = context.get("compiled")
    for op, want in sorted(context["collectives"].items()):
        got = (compiled or {}).get(op, {"count": 0, "bytes_per_device": 0.0})
        table.add_row(op, str(want["count"]), "-" if compiled is None else str(got["count"]),
                      human_bytes(want["bytes_per_device"]),
                      "-" if compiled is None else human_bytes(got["bytes_per_device"]))
    out.append(table)
    exact = "" if context["exact"] else " (approximate: XLA decides what this remat policy or pipeline recomputes)"
    out.append(f"[dim]predicted: {context['formula']}{exact}[/dim]")
    return out


def _bubble_formula(schedule: str) -> str:
    """How `bubble_fraction_formula` was computed: split-backward schedules run F, B and W per microbatch-chunk."""
    facts = schedule_facts(schedule)
    kind = "closed form" if facts.bubble_exact else "lower bound"
    return f"{kind} (p-1)/(3*v*m+p-1)" if facts.split_backward else f"{kind} (p-1)/(v*m+p-1)"


def _receive_buffers(pipe) -> str:
    """The receive slots in words: split-backward plans keep activations and cotangents in one buffer."""
    if pipe.saved_slots:  # split-backward plans only
        return (f"{pipe.activation_slots} + 1 spare, shared by activations and cotangents; B keeps what W needs in "
                f"{pipe.saved_slots} more slots of {human_bytes(pipe.saved_bytes_per_microbatch)}, "
                f"{human_bytes(pipe.saved_bytes_reserved)} reserved")
    return (f"{pipe.activation_slots} + 1 spare for activations, {pipe.cotangent_slots} + 1 spare for "
            "cotangents")

"""`spmd-train plan`: which layout to use for a config on given devices, ranked before renting them."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from spmd_train.analysis.plan.candidate import Candidate
from spmd_train.analysis.plan.explain import explain
from spmd_train.analysis.plan.labels import config_dict, label, label_parts
from spmd_train.analysis.plan.model import analysis_lines
from spmd_train.analysis.plan.plan_report import (
    compiled_json,
    count,
    estimate_json,
    quantized_compute_line,
    rejection_json,
    require_layouts,
    row_json,
    seconds,
    ties,
    time_parts,
    why_lost,
)
from spmd_train.analysis.plan.profile import load_profile, profile_hardware
from spmd_train.analysis.plan.search import KEEP, SearchResult, search
from spmd_train.analysis.plan.target import target_for
from spmd_train.analysis.plan_compile import CompileStage, compile_stage
from spmd_train.config import load_config
from spmd_train.config.schema import Config
from spmd_train.errors import ConfigError
from spmd_train.hardware import KINDS
from spmd_train.units import GiB, human_bytes


def add_plan_parser(sub: Any) -> None:
    """The `plan` subcommand and its options."""
    plan = sub.add_parser(
        "plan", help="rank every mesh, ZeRO stage, remat, schedule and context layout for given devices",
        description="Enumerate every layout of a config on N devices of a kind (or a TPU topology), reject what "
        "cannot run or fit with one reason each, rank the rest by estimated step time, and compile the best K "
        "to put compiled memory and collective bytes in place of the estimates.")
    plan.add_argument("config", help="run config YAML (its model, batch and training settings; the layout is chosen)")
    plan.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    plan.add_argument("--devices", type=int, metavar="N", help="how many devices (with --hardware)")
    plan.add_argument("--hardware", metavar="KIND", help=f"accelerator kind: {', '.join(KINDS)}")
    plan.add_argument("--topology", metavar="NAME", help="a TPU slice, e.g. v5p:8x8x16, or slices over DCN, "
                      "e.g. 2xv5p:8x8x8 (instead of --devices and --hardware)")
    plan.add_argument("--compile", type=int, default=5, metavar="K",
                      help="compile the best K and re-rank them on compiled figures (default 5; 0: analytic only)")
    plan.add_argument("--top", type=int, default=10, metavar="T", help="rows of the table (default 10)")
    plan.add_argument("--explain", metavar="LABEL", help="one layout's full breakdown, or why it was rejected "
                      "(a label as the table prints it; analytic only)")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    plan.add_argument("--write-config", metavar="OUT.yaml", help="write a runnable config of the winner")
    plan.add_argument("--profile", metavar="FILE", help="a `bench-collectives` profile of this kind of device: its "
                      "measured link α/bandwidth and achievable compute fraction replace the table's figures")


def run_plan(args: argparse.Namespace) -> int:
    """Search, compile, and print (or explain, or write) as the options ask; ConfigError for bad input."""
    cfg = load_config(args.config, args.overrides)
    target = target_for(args.devices, args.hardware, args.topology)
    if args.profile:
        measured = profile_hardware(load_profile(args.profile), target.hardware, f"--profile {args.profile}",
                                    target.devices)
        target = dataclasses.replace(target, hardware=measured)
    asked = label_parts(args.explain) if args.explain else None  # a bad label is refused before the search
    result = search(cfg, target, keep=max(KEEP, args.top, args.compile))
    if asked is not None:
        return _explain(result, args.explain, asked, args.json)
    require_layouts(result, args.config)
    if args.compile and target.platform == "tpu":
        _host_compiles_for_tpu()
    stage = compile_stage(result, max(args.compile, 0))
    if not stage.order:
        raise ConfigError("every layout that fits by the estimates was dropped when compiled: " + "; ".join(
            f"{label(r.candidate)}: {r.detail}" for r in stage.dropped) + " (valid: more devices, or --compile 0 "
            "to see the analytic ranking)")
    if args.write_config:
        _write_config(cfg, stage, args, Path(args.write_config))
    if args.json:
        print(json.dumps(_plan_json(args, result, stage), indent=2, default=_jsonable))
    else:
        _render(args, result, stage)
    return 0


def _host_compiles_for_tpu() -> None:
    # libtpu compiles on this host; jax itself runs on the CPU (as `describe --topology`).
    import jax

    try:
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:
        pass


def _explain(result: SearchResult, text: str, parts: tuple[Candidate, frozenset[str]], as_json: bool) -> int:
    asked, given = parts
    found = explain(result, asked, given)
    if found.estimate is None:
        rejected = found.rejection
        out = {"label": label(asked), "rejected": rejection_json(rejected)}
        lines = [f"{label(asked)}: rejected at {rejected.label}: {rejected.detail} ({rejected.kind})"]
    else:
        est = found.estimate
        place = next((i for i, r in enumerate(result.ranked, 1) if r.label == label(est.candidate)), None)
        out = {"label": label(est.candidate), "asked": text, "rank": place, **estimate_json(est),
               "not_ranked": rejection_json(found.rejection) if found.rejection else None}
        lines = []
        if found.tried > 1:
            lines.append(f"{text!r} leaves settings to choose: of the {found.tried} it names, the "
                         f"{'fastest that fits' if est.fits else 'smallest (none fits)'} is {label(est.candidate)}")
        body = _breakdown(est, place, result)
        why = [f"not ranked: {found.rejection.detail}"] if found.rejection is not None else []
        lines += body[:1] + why + body[1:]
    print(json.dumps(out, indent=2, default=_jsonable) if as_json else "\n".join(lines))
    return 0


def _breakdown(est, place, result: SearchResult) -> list[str]:
    m, t = est.memory, est.timing
    faster = sum(r.estimate.timing.step < t.step for r in result.ranked)
    if place:
        rank = f"rank {place} of the {len(result.ranked)} ranked"
    elif not est.fits:
        rank = "does not fit"
    else:  # slower than the best the search ranked exactly, or settings outside its grid
        rank = f"fits, not ranked (its time would place it {faster + 1} of the {len(result.ranked)} ranked)"
    lines = [f"{label(est.candidate)}: {rank}; {seconds(t.step)} a step, {t.tokens_per_second:,.0f} tokens/s, "
             f"MFU {t.mfu:.1%}", f"memory per device: {human_bytes(m.peak)} peak of "
             f"{human_bytes(result.target.hardware.hbm_bytes)}"]
    lines += analysis_lines(m, est.comm)
    lines.append("time per step:")
    for part, s in time_parts(t, est.candidate.devices).items():
        lines.append(f"  {part:40s} {seconds(s)}")
    if result.workload.matmul != "default":
        lines.append(quantized_compute_line(result.shape, result.workload, result.target.hardware))
    return lines


def _write_config(cfg: Config, stage: CompileStage, args: argparse.Namespace, out: Path) -> None:
    winner = stage.order[0]
    raw = config_dict(cfg, winner.estimate.candidate)
    if not any(o.startswith("run.dir=") for o in args.overrides):
        # Its own run directory: the base config's may hold checkpoints of another layout.
        raw["run"]["dir"] = f"runs/{out.stem}"
    compiled = stage.compiled.get(winner.label)
    how = f"compiled on {stage.where}" if compiled else "analytic estimate"
    step = compiled.timing.step if compiled else winner.estimate.timing.step
    head = (f"# Written by `spmd-train plan {args.config} {' '.join(args.overrides)} "
            f"{_target_args(args)}`: the winner, {winner.label}\n# {seconds(step)} a step ({how}); "
            f"train with: spmd-train train {out}\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        f.write(head + yaml.safe_dump(raw, sort_keys=False))
    try:
        load_config(tmp)  # what is written must load back
    except BaseException:
        os.unlink(tmp)
        raise
    os.replace(tmp, out)


def _target_args(args: argparse.Namespace) -> str:
    where = f"--topology {args.topology}" if args.topology else f"--devices {args.devices} --hardware {args.hardware}"
    return f"{where} --profile {args.profile}" if args.profile else where


def _rows(result: SearchResult, stage: CompileStage, top: int):
    return [(i, r, stage.compiled.get(r.label)) for i, r in enumerate(stage.order[:top], 1)]


def _plan_json(args: argparse.Namespace, result: SearchResult, stage: CompileStage) -> dict[str, Any]:
    order = stage.order
    return {
        "config": args.config, "overrides": list(args.overrides), "target": result.target.describe(),
        "devices": result.target.devices, "hardware": result.target.hardware.kind,
        "winner": order[0].label if order else None,
        "runner_up": _runner_up(result, stage),
        "ranked": [row_json(i, r, comp) for i, r, comp in _rows(result, stage, args.top)],
        "rejected": [{"rule": rule, "kind": kind, "count": n, "example": example}
                     for rule, kind, n, example in result.counts()],
        "analytic": {"candidates": result.candidates, "meshes": result.meshes, "evaluations": result.evaluations,
                     "seconds": result.seconds, "candidates_per_second": result.rate, "ranked": len(result.ranked),
                     "slower": result.slower},
        "compile": {"k": args.compile, "where": stage.where, "skipped": stage.skipped, "seconds": stage.seconds,
                    "dropped": [rejection_json(r) for r in stage.dropped],
                    "compiled": {k: compiled_json(v, result.target.devices) for k, v in stage.compiled.items()}},
    }


def _runner_up(result: SearchResult, stage: CompileStage) -> str | None:
    """Why the runner-up lost; when it ties, also why the first slower layout did."""
    rows = [(r, stage.compiled[r.label].timing if r.label in stage.compiled else r.estimate.timing)
            for r in stage.order]
    if len(rows) < 2:
        return None
    (_, first), (second, timing) = rows[:2]
    devices = result.target.devices
    text = why_lost(first, timing, second.label, devices)
    if ties(first, timing):
        slower = next(((r, t) for r, t in rows[2:] if t.step > first.step and not ties(first, t)), None)
        if slower is not None:
            text += "; the first slower one: " + why_lost(first, slower[1], slower[0].label, devices).removeprefix(
                "the runner-up, ")
    return text


def _render(args: argparse.Namespace, result: SearchResult, stage: CompileStage) -> None:
    console = Console(width=None if sys.stdout.isatty() else 180)
    cfg, shape = result.cfg, result.shape
    console.print(f"[bold]plan[/bold] {args.config}: {cfg.model.preset or 'model'} ({count(shape.total_params)} "
                  f"parameters), batch {cfg.train.global_batch_size} x {cfg.train.seq_len} tokens, on "
                  f"{result.target.describe()}")
    console.print(f"analytic stage: {result.candidates:,} candidates over {result.meshes:,} meshes in "
                  f"{result.seconds:.2f} s ({result.rate:,.0f} candidates/s; {result.evaluations:,} memory and time "
                  f"estimates); {len(result.ranked)} ranked exactly, {result.slower:,} more fit and are slower")
    table = Table(title=f"Best {min(args.top, len(stage.order))} layouts", title_justify="left")
    for col in ("#", "layout", "memory / device", "communication per axis (exposed)", "bubble", "step",
                "tokens/s", "MFU", "fits", "compiled vs estimate"):
        table.add_column(col, justify="left" if col in ("layout", "communication per axis (exposed)",
                                                         "compiled vs estimate") else "right")
    for i, r, comp in _rows(result, stage, args.top):
        est = r.estimate
        t = comp.timing if comp else est.timing
        peak = comp.peak if comp else est.memory.peak
        comm = "\n".join(f"{' x '.join(a.axes)}: {seconds(a.seconds)} ({seconds(a.exposed)})" for a in t.axes)
        table.add_row(str(i), r.label, f"{peak / GiB:.2f} GiB", comm or "-", f"{t.bubble:.1%}", seconds(t.step),
                      f"{t.tokens_per_second:,.0f}", f"{t.mfu:.1%}", "yes" if (comp.fits if comp else est.fits)
                      else "no", _compiled_cell(comp))
    console.print(table)
    runner = _runner_up(result, stage)
    if runner:
        console.print(f"why {stage.order[0].label} won: {runner}")
    rejected = Table(title="Rejected (candidates per reason)", title_justify="left")
    for col in ("candidates", "kind", "reason", "example"):
        rejected.add_column(col, justify="right" if col == "candidates" else "left")
    for rule, kind, n, example in result.counts():
        rejected.add_row(f"{n:,}", kind, rule, example)
    console.print(rejected)
    if stage.skipped:
        console.print(f"compile stage skipped: {stage.skipped}")
    else:
        console.print(f"compile stage: {len(stage.compiled)} compiled on {stage.where} in {stage.seconds:.1f} s; "
                      f"compiled figures replace the estimates and those rows are ranked again")
        for r in stage.dropped:
            console.print(f"  dropped {label(r.candidate)}: {r.detail}")
        notes = sorted({n for comp in stage.compiled.values() for n in comp.notes})
        for note in notes:
            console.print(f"  note: {note}")


def _compiled_cell(comp) -> str:
    if comp is None:
        return "-"
    if comp.peak_compiled is None:
        return "refused by the compiler (memory)"
    lines = [f"memory {comp.peak_compiled / GiB:.3f} GiB, est. {comp.reference.memory.peak / GiB:.3f} "
             f"({comp.memory_error:+.0%})"]
    for axes, (estimated, compiled) in comp.bytes_error().items():
        error = f"{estimated / compiled - 1:+.0%}" if compiled else "none compiled"
        lines.append(f"{' x '.join(axes)}: {compiled / GiB:.3f} GiB, est. {estimated / GiB:.3f} ({error})")
    return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)

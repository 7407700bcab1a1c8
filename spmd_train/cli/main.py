"""`spmd-train`: the command line over the library's public API."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import jax

from spmd_train.analysis import describe
from spmd_train.analysis.render import render, render_rules
from spmd_train.cli.bench_collectives import add_bench_parser, run_bench
from spmd_train.cli.convert import add_convert_parser, run_convert
from spmd_train.cli.generate import add_generate_parser, run_generate
from spmd_train.cli.plan import add_plan_parser, run_plan
from spmd_train.cli.schedule import schedule_help, schedule_report, virtual_help
from spmd_train.config import load_config
from spmd_train.config.resolved_rules import resolve_rules
from spmd_train.console_log import log_to_stderr
from spmd_train.data import prepare_data
from spmd_train.devices import simulate_devices, start_distributed
from spmd_train.errors import ConfigError, TrainingHalted
from spmd_train.train import interrupts
from spmd_train.train.loop import train

EXIT_BAD_INPUT = 2
EXIT_HALTED = 3
"""The run stopped itself to protect its checkpoints (non-finite steps, too many skipped in a row)."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `spmd-train` console script; returns the process exit code."""
    parser = _parser()
    # Overrides may also follow options (`describe CFG --topology v5e:2x4 model.x=1`), which
    # argparse leaves over as unknown arguments.
    args, extra = parser.parse_known_args(argv)
    if extra and (not hasattr(args, "overrides") or any(a.startswith("-") or "=" not in a for a in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    _log_to_stderr()
    interrupts.install()
    try:
        if args.command == "prepare-data":
            path = prepare_data(args.inputs, args.out, tokenizer=args.tokenizer, name=args.name,
                                text_field=args.text_field)
            meta = json.loads(path.with_suffix(".json").read_text())
            print(f"wrote {meta['num_tokens']:,} tokens ({meta['num_documents']} documents, {meta['dtype']}, vocab "
                  f"{meta['vocab_size']}) to {path}; train on it with data.source=tokens data.paths=[{path}]")
            return 0
        if args.command == "schedule":
            print(schedule_report(args.schedule, args.stages, args.microbatches, args.virtual))
            return 0
        if args.command == "plan":
            return run_plan(args)
        if args.command == "bench-collectives":
            return run_bench(args)
        if args.command == "generate":
            return run_generate(args)
        if args.command == "convert":
            return run_convert(args)
        cfg = load_config(args.config, args.overrides)
        if args.command == "describe" and args.rules:
            rules = resolve_rules(cfg)
            if args.json:
                print(json.dumps(rules.to_json(), indent=2))
            else:
                render_rules(rules.to_json())
            return 0
        if args.command == "describe" and args.topology:
            _host_compiles_for_tpu()
        else:
            simulate_devices(cfg.run.simulate_devices)
            _start_distributed(cfg.run)
        if args.command == "describe":
            report = describe(cfg, topology=args.topology)
            if args.json:
                print(json.dumps(report.to_json(), indent=2))
            else:
                render(report)
        elif args.command == "train":
            result = train(cfg)
            if jax.process_index() == 0:
                print(_summary(cfg, result))
    except ConfigError as err:
        print(f"spmd-train: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except TrainingHalted as err:
        print(f"spmd-train: stopped: {err}", file=sys.stderr)
        return EXIT_HALTED
    except BrokenPipeError:
        # The reader stopped reading (`| head -1`): what it read is complete, and that is not an error. Point
        # stdout at /dev/null so the interpreter's last flush does not raise again (Python's documented recipe).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        # Only outside the training loop (which stops at the next step and saves): while starting, restoring or
        # compiling. What the run already saved is untouched, and a half-written output is removed on the way up.
        print(f"spmd-train: interrupted (Ctrl-C) while {_STAGE.get(args.command, 'working')}; nothing was trained "
              "or saved in this call, and what was there before is intact", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        # Leave at once: XLA's compiler threads may still run, and tearing the interpreter down under them can
        # crash (the segfault after the traceback).
        os._exit(EXIT_INTERRUPTED)
    return 0


EXIT_INTERRUPTED = 130
"""128 + SIGINT, the shell's convention for a command stopped by Ctrl-C."""
_STAGE = {"train": "starting the run (restoring or compiling)", "describe": "compiling",
          "plan": "searching or compiling layouts",
          "bench-collectives": "timing collectives", "convert": "converting (nothing is left half-written)",
          "generate": "restoring or generating",
          "prepare-data": "tokenizing", "schedule": "building the schedule"}


def _start_distributed(run) -> None:
    try:
        start_distributed(run)
    except ValueError as err:  # jax's cluster detection found none to join (run.distributed=true on a laptop)
        raise ConfigError(f"run.distributed={str(run.distributed).lower()}, run.coordinator={run.coordinator!r}: "
                          f"jax could not start the multi-process runtime ({err}) (valid: run.distributed=false on one "
                          "host; run.distributed=true inside a SLURM, Open MPI or TPU-pod job; or run.coordinator, "
                          "run.num_processes and run.process_id set by hand)") from None


def _log_to_stderr() -> None:
    # Our own handler even when libraries (absl via orbax) have claimed the root logger already.
    logger = log_to_stderr(over_root=True)
    logger.setLevel(logging.INFO)
    # Orbax logs its background threads' errors with their tracebacks; the one-line error stays, and the
    # paragraph this CLI prints names the directory and what is intact.
    for name in ("absl", "asyncio"):  # asyncio: "Task exception was never retrieved" of a failed write
        logging.getLogger(name).addFilter(_without_traceback)
    sys.unraisablehook = _quiet_unraisable


def _without_traceback(record: logging.LogRecord) -> bool:
    record.exc_info, record.exc_text = None, None
    return True


_ORBAX_TEARDOWN = ("Event loop is closed", "sys.meta_path is None")


def _quiet_unraisable(unraisable) -> None:
    # After a failed async write, Orbax's abandoned writer coroutines are collected on a closed event loop
    # and Python prints each as "Exception ignored": noise, the write's own error is already reported.
    if isinstance(unraisable.exc_value, (RuntimeError, ImportError)) and any(
            text in str(unraisable.exc_value) for text in _ORBAX_TEARDOWN):
        return
    sys.__unraisablehook__(unraisable)


def _summary(cfg, result) -> str:
    if not result.trained:
        return f"nothing to do: the run in {cfg.run.dir} is already at train.steps={cfg.train.steps}"
    last = result.history[-1]
    floor = f" (best achievable {result.loss_floor:.4f})" if result.loss_floor is not None else ""
    how = f"stopped by {result.stopped_by} at" if result.stopped_by else "done:"
    return (f"{how} step {last['step']}, loss {last['loss']:.4f}{floor}; metrics in {cfg.run.dir}/metrics.jsonl, "
            f"checkpoints in {cfg.run.dir}/checkpoints, TensorBoard logs in {cfg.run.dir}/tensorboard")


def _host_compiles_for_tpu() -> None:
    # The TPU programs are compiled by libtpu on this host; jax itself runs on the CPU.
    try:
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:
        pass


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spmd-train", description="Train transformers on any mesh with JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model from a run config",
                           description="Train a model from a run config.")
    train.add_argument("config", help="run config YAML (e.g. configs/tiny.yaml)")
    train.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, e.g. mesh.tensor=2")
    describe_cmd = sub.add_parser(
        "describe",
        help="compile one train step and report per-device memory, FLOPs and collectives",
        description="Compile one train step on abstract inputs (nothing is allocated or run) and report "
        "per-device memory, FLOPs and the collectives of one step per mesh axis.",
    )
    describe_cmd.add_argument("config", help="run config YAML")
    describe_cmd.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    describe_cmd.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    describe_cmd.add_argument("--rules", action="store_true",
                              help="print only the effective sharding rules (the preset, the config's entries and "
                              "the rules the code adds); compiles nothing")
    describe_cmd.add_argument("--topology", metavar="NAME",
                              help="compile for a TPU slice from this host, e.g. v5e:2x4, v5p:4x4x4 "
                              "(needs the tpu-aot extra)")
    add_plan_parser(sub)
    add_bench_parser(sub)
    add_generate_parser(sub)
    add_convert_parser(sub)
    prep = sub.add_parser("prepare-data", help="tokenize text or JSONL files into a .bin token file",
                          description="Tokenize UTF-8 text files (one document each) and JSONL files (one document "
                          "per line) into OUT/NAME.bin with sidecars, streaming; each document ends with the "
                          "tokenizer's end-of-text id.")
    prep.add_argument("inputs", nargs="+", metavar="INPUT",
                      help="UTF-8 text files, or .jsonl files of JSON objects; a .gz suffix is decompressed")
    prep.add_argument("--out", required=True, help="output directory")
    prep.add_argument("--tokenizer", default="byte",
                      help="byte (default), tiktoken:NAME, sentencepiece:PATH or hf:DIR (its tokenizer.json)")
    prep.add_argument("--name", default="data", help="file name stem (default: data)")
    prep.add_argument("--text-field", default="text", metavar="KEY",
                      help="the field of each JSONL object that holds the document's text (default: text)")
    sched = sub.add_parser("schedule", help="print a pipeline schedule's timeline, bubble and in-flight activations",
                           description="Print which stage runs which forward/backward at each tick of a pipeline "
                           "schedule, and its bubble fraction, peak in-flight activations and transfers.")
    sched.add_argument("--stages", type=int, required=True, metavar="P", help="pipeline stages (mesh.pipeline)")
    sched.add_argument("--microbatches", type=int, required=True, metavar="M", help="microbatches per step")
    sched.add_argument("--schedule", required=True, metavar="NAME", help=schedule_help())
    sched.add_argument("--virtual", type=int, metavar="V", help=virtual_help())
    return parser


if __name__ == "__main__":
    sys.exit(main())

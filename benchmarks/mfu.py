"""Training-step throughput and MFU per attention implementation (and matmul precision), side by side in one run.

Usage: python benchmarks/mfu.py [--model llama-1b] [--layers N] [--seq 4096] [--batch 8] [--steps 8]
                                [--impls cudnn pallas xla] [--matmuls default fp8 fp8-row int8] [--remat full]
                                [--offload none optimizer params layer_inputs]
Each implementation trains the same model from the same initial parameters on one device
(the first jax device) with `backends.attention=<impl>`: one warm-up step, then `--steps`
synchronous steps whose median time gives tokens/s and MFU. MFU uses our model-FLOP count
(`spmd_train.models.flops`: 6 x matmul parameters per token plus causal attention
6 x layers x seq x d_model, the masked half not counted) over the device's dense bf16 peak
(`spmd_train/hardware.py`). The first implementation is the baseline of the ratio column, and
every run's first-step loss must match the baseline's (same model, same data) before timing
counts. Defaults: llama-1b at 4k tokens on a GPU or TPU; the tiny model with XLA attention only
on CPU (the Pallas kernels are interpreted there: far too slow to time). `--matmuls default fp8` runs each
implementation with bfloat16 and with FP8 matmuls (`precision.matmul`; fp8-row: FP8 at row scales, int8: int8
matmuls; the MFU stays over the bf16 peak, so a quantized speed-up shows as a higher MFU) and records its own
section; `--layers` cuts the model's depth (a Llama-3-8B slice
that fits one GPU with its optimizer state). `--offload none optimizer params layer_inputs` runs each with the
optimizer state, the state and the layer stack's parameters, or each layer's input in host memory (docs/memory.md):
what the host link costs a step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax

from benchmarks.report import provenance, update_section
from spmd_train import load_config
from spmd_train.train.trainer import Trainer

MATMULS = {"default": ["precision.matmul=default"], "fp8": ["precision.matmul=fp8"],
           "fp8-row": ["precision.matmul=fp8", "precision.fp8_scaling=row"], "int8": ["precision.matmul=int8"]}
"""--matmuls choices and the precision keys each sets."""
OFFLOADS = {"none": [], "optimizer": ["offload.optimizer=true"],
            "params": ["offload.optimizer=true", "offload.params=true"],
            "layer_inputs": ["parallel.remat=offload_layer_inputs"]}
"""--offload choices and the keys each sets (docs/memory.md): the optimizer state, or each layer's input (in place
of --remat), in pinned host memory."""


def measure(impl: str, matmul: str, args, run_dir: str, offload: str = "none") -> dict:
    """Median step time, tokens/s and MFU of `steps` steps with attention `impl`, `matmul` matmuls and `offload`,
    plus the first loss."""
    overrides = [f"model.preset={args.model}", f"backends.attention={impl}", f"parallel.remat={args.remat}",
                 f"train.seq_len={args.seq}", f"train.global_batch_size={args.batch}",
                 f"train.steps={args.steps + 1}", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1",
                 *MATMULS[matmul], *OFFLOADS[offload], "checkpoint.every=0",
                 f"run.dir={run_dir}/{impl}-{matmul}-{offload}",
                 "run.simulate_devices=null", *([f"model.num_layers={args.layers}"] if args.layers else [])]
    cfg = load_config(None, overrides)
    if cfg.model.vocab_size > 4096:  # the Markov source's transition table must fit: sample 4k token ids
        cfg = load_config(None, [*overrides, "data.vocab_size=4096"])
    trainer = Trainer(cfg, devices=[jax.devices()[0]])
    try:
        trainer.init()
        trainer.compile()
        first = trainer.step()
        records = [trainer.step() for _ in range(args.steps)]
    finally:
        trainer.close()
    time_s = statistics.median(r["step_time_s"] for r in records)
    mfu = statistics.median(r["mfu"] for r in records) if records[0]["mfu"] is not None else None
    label = " + ".join([impl, *([matmul] if matmul != "default" else []),
                        *([f"offload {offload}"] if offload != "none" else [])])
    return {"impl": label, "loss": first["loss"], "time_s": time_s, "tokens_s": args.batch * args.seq / time_s,
            "mfu": mfu, "compile_s": trainer.compile_time_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    platform = jax.devices()[0].platform
    accelerator = platform in ("gpu", "tpu")
    parser.add_argument("--model", default="llama-1b" if accelerator else "tiny")
    parser.add_argument("--seq", type=int, default=4096 if accelerator else 128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--remat", default="full" if accelerator else "none")
    default_impls = {"gpu": ["cudnn", "pallas", "xla"], "tpu": ["pallas", "xla"]}.get(platform, ["xla"])
    parser.add_argument("--impls", nargs="+", default=default_impls)
    parser.add_argument("--matmuls", nargs="+", default=["default"], choices=tuple(MATMULS))
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--offload", nargs="+", default=["none"], choices=tuple(OFFLOADS))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as run_dir:
        results = [measure(impl, matmul, args, run_dir, offload) for impl in args.impls for matmul in args.matmuls
                   for offload in args.offload]
    base = results[0]
    for r in results[1:]:
        if abs(r["loss"] - base["loss"]) > 2e-2 * abs(base["loss"]):
            raise SystemExit(f"{r['impl']}: first-step loss {r['loss']:.4f} differs from {base['impl']}'s "
                             f"{base['loss']:.4f}: not the same computation")
    rows = ["| attention | first loss | step s | tokens/s | MFU | tokens/s vs " + base["impl"] + " | compile s |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "n/a (no peak for this device)"
        rows.append(f"| {r['impl']} | {r['loss']:.4f} | {r['time_s']:.4f} | {r['tokens_s']:.0f} | {mfu} | "
                    f"{r['tokens_s'] / base['tokens_s']:.2f} | {r['compile_s']:.1f} |")
    model = args.model + (f" ({args.layers} layers)" if args.layers else "")
    note = (f"{model}, {args.batch} x {args.seq} tokens per step, remat {args.remat}, one "
            f"{jax.devices()[0].device_kind}; median of {args.steps} steps after one warm-up step.")
    table = "\n".join(rows)
    print(note + "\n" + table)
    command = "python benchmarks/mfu.py " + " ".join(sys.argv[1:])
    if args.offload != ["none"]:
        key, title = (f"mfu-offload-{model.split()[0]}", f"Training-step tokens/s with host offload, {model} "
                      "(`benchmarks/mfu.py --offload`)")
    elif args.matmuls == ["default"]:
        key, title = "mfu", "Training-step MFU by attention implementation (`benchmarks/mfu.py`)"
    else:
        key, title = (f"mfu-fp8-{model.split()[0]}", f"Training-step tokens/s, FP8 against bfloat16 matmuls, {model} "
                      "(`benchmarks/mfu.py --matmuls`)")
    update_section(key, title, provenance(command.strip()) + "\n" + note + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()

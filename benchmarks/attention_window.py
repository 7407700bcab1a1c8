"""Sliding windows compiled for a TPU slice: attention FLOPs of a windowed layer against full causal attention, and
the bytes a windowed layer's ring context parallelism moves against the ring's.

Usage: python benchmarks/attention_window.py [--topology v5p:2x2x1] [--window 1024] [--seq-len 8192] [--record]

Llama-3-8B-shaped (configs/llama3-8b_v5p-512.yaml: 32 heads of 128, 8 K/V heads; 2 layers, which a scanned
stack makes enough) at --seq-len tokens, our Pallas kernels (blocks 512 x 512), full remat, compiled through
libtpu (`tpu-aot` extra; no TPU needed), each `spmd-train describe --json` in its own process: every layer full,
then every layer sliding with --window. FLOP convention: `models.flops` (attention 12 x heads x head_dim x keys
per query per token, s / 2 keys for a full layer, W - W^2 / 2s for a sliding one); the compiled count is what the
kernels run, per visible 512 x 512 block pair (`analysis.hlo`), the forward twice under full remat. Then the same
two layers with the tokens over sequence=4 under parallel.context_parallel=ring: the collective-permute bytes per
device per step of each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import provenance, update_section  # noqa: E402


def describe_json(topology: str, overrides: list[str]) -> dict:
    """`spmd-train describe --json` of the Llama-3-8B config for `topology` with `overrides`, in its own process."""
    command = [sys.executable, "-m", "spmd_train", "describe", "configs/llama3-8b_v5p-512.yaml", "--json",
               "--topology", topology, "model.num_layers=2", "parallel.remat=full", "backends.attention=pallas",
               *overrides]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"describe failed ({' '.join(overrides)}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def permute_bytes(report: dict) -> float:
    """Collective-permute bytes one device sends per step."""
    return sum(c["bytes"] for c in report["collectives"] if c["op"] == "collective-permute")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5p:2x2x1")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=8192)
    args = parser.parse_args()
    chips = 1
    for size in args.topology.split(":")[1].split("x"):
        chips *= int(size)
    common = [f"train.seq_len={args.seq_len}", f"train.global_batch_size={chips}", "mesh.tensor=1"]
    windowed = [f"model.sliding_window={args.window}"]
    rows, reports = [], {}
    for name, extra in (("full", []), (f"sliding {args.window}", windowed)):
        report = describe_json(args.topology, [*common, f"mesh.fsdp={chips}", *extra])
        d = report["per_device"]
        reports[name] = d
        rows.append(f"| {name} | {d['attention_flops']:.4g} | {d['model_attention_flops']:.4g} | "
                    f"{d['attention_flops'] / d['model_attention_flops']:.2f} |")
    full, slid = reports["full"], reports[f"sliding {args.window}"]
    ring_rows = []
    ring = [*common, f"mesh.fsdp={chips // 4}", "mesh.sequence=4", "parallel.context_parallel=ring"]
    if chips % 4 == 0:
        ring_full = permute_bytes(describe_json(args.topology, ring))
        ring_window = permute_bytes(describe_json(args.topology, [*ring, *windowed]))
        ring_rows = [
            "",
            f"Ring context parallelism over sequence=4 (fsdp {chips // 4}), collective-permute bytes per device per "
            "step:",
            "",
            "| layers | bytes | vs full |",
            "|---|---|---|",
            f"| full (ring) | {ring_full:.4g} | 1.00 |",
            f"| sliding {args.window} (neighbour tails, `parallel.halo`) | {ring_window:.4g} | "
            f"{ring_window / ring_full:.3f} |",
        ]
    body = "\n".join([
        provenance(f"python benchmarks/attention_window.py --topology {args.topology} --window {args.window} "
                   f"--seq-len {args.seq_len}"),
        f"Llama-3-8B-shaped, 2 layers, {args.seq_len} tokens x {chips} rows, fsdp {chips}, Pallas kernels 512 x 512, "
        "full remat. Attention FLOPs per device per step:",
        "",
        "| layers | compiled (kernels) | model count | compiled / model |",
        "|---|---|---|---|",
        *rows,
        "",
        f"Sliding against full: compiled {slid['attention_flops'] / full['attention_flops']:.3f}x, model count "
        f"{slid['model_attention_flops'] / full['model_attention_flops']:.3f}x (the band's area: keys per query "
        f"{args.window} - {args.window}^2 / (2 x {args.seq_len}) against {args.seq_len} / 2; the kernels compute "
        "whole 512 x 512 blocks, so the diagonal blocks and those at the window's edge count whole).",
        *ring_rows,
    ])
    update_section("attention_window", "Sliding windows on a TPU slice (benchmarks/attention_window.py)", body)


if __name__ == "__main__":
    main()

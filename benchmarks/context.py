"""Context parallelism: step time and memory of allgather, ring and ulysses against sequence = 1.

Usage: python benchmarks/context.py [--part speed memory] [--seq-len 2048] [--steps 5]

`speed` (section `context`): the same tokens per device, split two ways. On 8 simulated CPU devices
in this process, the tiny model (fp32) at --seq-len tokens, global batch 8, as `fsdp` 8 (sequence 1,
each device one whole row) and as `sequence` 8 (each device 1/8 of every row) with each scheme:
compiled per-device memory and measured step time (indicative only: 8 simulated devices share the
host's cores, collectives are memory copies). Then the same comparison compiled for v5p:2x2x2
through libtpu (no TPU needed; `tpu-aot` extra): Llama-3.2-1B at 32k tokens, full remat, our Pallas
kernels; it shows what each scheme costs over plain attention at equal tokens.
`memory` (section `context_memory`): what splitting one long sequence saves. A 32k-token sequence
per row (global batch 4), sequence 1 against sequence 8 with each scheme, compiled on CPU (one
device against 8; Pallas kernels interpreted, so attention is linear in memory as on hardware) and
for TPU (v5e:2x2 as fsdp 4 against v5e:4x8 as fsdp 4 x sequence 8); then
configs/llama3-8b_128k_v5p.yaml at full size. Each `spmd-train describe --json` for a TPU slice runs
in its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

from benchmarks.report import provenance, update_section  # noqa: E402
from spmd_train import Engine, load_config  # noqa: E402
from spmd_train.analysis import describe  # noqa: E402
from spmd_train.data import make_source  # noqa: E402

SCHEMES = ("allgather", "ring", "ulysses")
SMALL = ["model.preset=tiny", "model.d_model=512", "model.d_ff=1024", "model.vocab_size=32000", "mesh.tensor=1",
         "train.seq_len=32768", "parallel.remat=full"]
"""The memory part's model: tiny with 64-wide heads (what the TPU kernels take), 2 layers."""
TPU_BASE = ["configs/llama3-8b_v5p-512.yaml", "--topology", "v5p:2x2x2", "model.preset=llama-1b", "mesh.tensor=1",
            "train.global_batch_size=8", "train.seq_len=32768", "parallel.remat=full", "backends.attention=auto"]


def layouts() -> dict[str, list[str]]:
    """Name -> mesh overrides: the baseline and each scheme at sequence 8, all at the same global batch."""
    out = {"sequence 1 (fsdp 8)": ["mesh.fsdp=8"]}
    out.update({f"{how} (sequence 8)": ["mesh.fsdp=1", "mesh.sequence=8", f"parallel.context_parallel={how}"]
                for how in SCHEMES})
    return out


def cpu_row(name: str, overrides: list[str], seq_len: int, steps: int) -> dict:
    cfg = load_config(ROOT / "configs/tiny.yaml", ["mesh.tensor=1", f"train.seq_len={seq_len}",
                                                   "train.global_batch_size=8", "model.param_dtype=float32",
                                                   "model.compute_dtype=float32", *overrides])
    engine = Engine.build(cfg, jax.devices())
    state, data = engine.init_state(), make_source(cfg)
    compiled = engine.train_step.lower(engine.abstract_state(), engine.abstract_batch()).compile()
    mem = compiled.memory_analysis()
    batches = [data.batch(i, engine.batch_sharding) for i in range(steps + 1)]
    state, metrics = compiled(state, batches[0])
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for batch in batches[1:]:
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    return {"name": name, "seconds": (time.perf_counter() - start) / steps, "temp": mem.temp_size_in_bytes,
            "peak": mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes, "loss": float(metrics["loss"])}


def describe_json(args: list[str]) -> dict:
    """`spmd-train describe ARGS --json` in a fresh process (libtpu reads its flags once per process)."""
    cmd = [sys.executable, "-m", "spmd_train", "describe", *args, "--json"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return json.loads(subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout)


def gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def speed(args) -> None:
    rows = [cpu_row(name, o, args.seq_len, args.steps) for name, o in layouts().items()]
    base = rows[0]
    cpu = "\n".join(f"| {r['name']} | {r['seconds'] * 1e3:.0f} ms | {r['seconds'] / base['seconds']:.2f} | "
                    f"{gib(r['temp'])} | {r['temp'] / base['temp']:.3f} | {gib(r['peak'])} | {r['loss']:.4f} |"
                    for r in rows)
    tpu = [(name, describe_json([*TPU_BASE, *overrides])) for name, overrides in layouts().items()]
    tbase = tpu[0][1]["per_device"]
    lines = []
    for name, report in tpu:
        d, ctx = report["per_device"], report.get("context") or {}
        moved = sum(c["bytes_per_device"] for c in ctx.get("compiled", {}).values())
        lines.append(f"| {name} | {gib(d['temp_bytes'])} | {d['temp_bytes'] / tbase['temp_bytes']:.3f} | "
                     f"{gib(d['peak_bytes'])} | {d['peak_bytes'] / tbase['peak_bytes']:.3f} | "
                     f"{gib(moved) if ctx else '-'} |")
    body = (provenance("python benchmarks/context.py --part speed") + "\n"
            f"The same tokens per device, split two ways: the tiny model (fp32, XLA attention) at {args.seq_len} "
            f"tokens, global batch 8, on 8 simulated CPU devices; mean of {args.steps} steps after one. Temp: the "
            "compiled step's temporaries (activations and attention workspace); peak: argument + output + temp - "
            "alias, per device. CPU step times are indicative only. The losses agree: every layout computes the "
            "same step.\n\n"
            "| layout | step | / sequence 1 | temp | / sequence 1 | peak | loss after the steps |\n"
            "|---|---:|---:|---:|---:|---:|---:|\n" + cpu + "\n\n"
            "The same comparison compiled for v5p:2x2x2 through libtpu on this host (no TPU): Llama-3.2-1B, "
            "32768 tokens, global batch 8, full remat, our Pallas kernels (`spmd-train describe "
            + " ".join(TPU_BASE) + " MESH --json`); attention bytes: what attention sends over `sequence` per "
            "device per step. At equal tokens per device this is each scheme's overhead over plain attention.\n\n"
            "| layout | temp | / sequence 1 | peak | / sequence 1 | attention bytes |\n"
            "|---|---:|---:|---:|---:|---:|\n" + "\n".join(lines) + "\n")
    update_section("context", "Context parallelism at equal tokens per device: speed and overhead "
                   "(`benchmarks/context.py --part speed`)", body)


def memory() -> None:
    def cpu(overrides, devices):
        cfg = load_config(None, [*SMALL, "train.global_batch_size=1", "backends.attention=pallas", *overrides])
        return describe(cfg, devices=devices).per_device

    def tpu(topology, overrides):
        return describe_json(["configs/tiny.yaml", "--topology", topology, *SMALL, "train.global_batch_size=4",
                         "backends.attention=auto", *overrides])["per_device"]

    cases = {"sequence 1": (["mesh.fsdp=1"], ["mesh.fsdp=4"])}
    cases.update({f"{how}, sequence 8": (["mesh.fsdp=1", "mesh.sequence=8", f"parallel.context_parallel={how}"],
                                         ["mesh.fsdp=4", "mesh.sequence=8", f"parallel.context_parallel={how}"])
                  for how in SCHEMES})
    rows = []
    for i, (name, (cpu_overrides, tpu_overrides)) in enumerate(cases.items()):
        here = cpu(cpu_overrides, jax.devices()[:1] if i == 0 else jax.devices())
        slice_ = tpu("v5e:2x2" if i == 0 else "v5e:4x8", tpu_overrides)
        rows.append((name, here, slice_))
    base_cpu, base_tpu = rows[0][1], rows[0][2]
    table = "\n".join(f"| {name} | {gib(c['temp_bytes'])} | {c['temp_bytes'] / base_cpu['temp_bytes']:.3f} | "
                       f"{gib(t['temp_bytes'])} | {t['temp_bytes'] / base_tpu['temp_bytes']:.3f} |"
                       for name, c, t in rows)
    full = describe_json(["configs/llama3-8b_128k_v5p.yaml", "--topology", "v5p:4x4x4"])
    d, ctx = full["per_device"], full["context"]
    moved = sum(c["bytes_per_device"] for c in ctx["compiled"].values())
    hops = ctx["compiled"]["collective-permute"]["count"]
    body = (provenance("python benchmarks/context.py --part memory") + "\n"
            "What splitting one long sequence saves: 32768 tokens per row, the activation memory (the compiled "
            "step's temporaries) per device with the row whole on a device against split over `sequence` 8. "
            "Model: tiny with 64-wide heads (`" + " ".join(SMALL) + "`), full remat. CPU: one row, one device "
            "against 8 (Pallas kernels interpreted, linear in memory as on hardware). TPU (libtpu AOT on this host): "
            "global batch 4, v5e:2x2 as fsdp 4 against v5e:4x8 as fsdp 4 x sequence 8, our Pallas kernels. "
            "The acceptance bound is 0.2.\n\n"
            "| layout | CPU temp | / sequence 1 | TPU temp | / sequence 1 |\n|---|---:|---:|---:|---:|\n"
            + table + "\n\n"
            f"`configs/llama3-8b_128k_v5p.yaml` at full size (Llama-3-8B, 131072 tokens, fsdp 8 x sequence 8 ring "
            f"on v5p:4x4x4): peak {gib(d['peak_bytes'])} per chip of {gib(full['hbm_bytes'])} (fits: {full['fits']}), "
            f"temp {gib(d['temp_bytes'])}; {hops} collective-permutes, {gib(moved)} per chip per step (predicted "
            f"{gib(ctx['collectives']['collective-permute']['bytes_per_device'])}); compiled in "
            f"{full['compile_seconds']:.0f} s.\n")
    update_section("context_memory", "Context parallelism: memory for one long sequence "
                   "(`benchmarks/context.py --part memory`)", body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", nargs="+", choices=("speed", "memory"), default=["speed", "memory"])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if "speed" in args.part:
        speed(args)
    if "memory" in args.part:
        memory()


if __name__ == "__main__":
    main()

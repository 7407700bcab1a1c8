"""Compile time of the train step against depth: the layer scan should keep it flat.

Usage: python benchmarks/compile.py [--layers 2 8 16 32] [--repeats 3]
Runs the tiny model's sharded step (fsdp 4 x tensor 2 on 8 simulated CPU devices) at each
depth, lowers and compiles it `repeats` times (fresh trace each time), and reports the
median compile time and its ratio to the shallowest depth.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax

jax.config.update("jax_num_cpu_devices", 8)

from benchmarks.report import provenance, update_section  # noqa: E402
from spmd_train import Engine, load_config  # noqa: E402


def compile_seconds(layers: int) -> float:
    """Wall time to trace, lower and compile one train step of a `layers`-deep tiny model."""
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml", [f"model.num_layers={layers}"])
    engine = Engine.build(cfg)
    state = engine.abstract_state()
    tokens = jax.ShapeDtypeStruct((cfg.train.global_batch_size, cfg.train.seq_len + 1), "int32",
                                  sharding=engine.batch_sharding)
    start = time.perf_counter()
    jax.jit(engine.step_fn, in_shardings=(engine.state_shardings, engine.batch_sharding),
            donate_argnums=0).lower(state, tokens).compile()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    compile_seconds(args.layers[0])  # warm up jax's own caches of Python-side objects
    # Interleave depths across repeats so machine noise hits every depth alike.
    times: dict[int, list[float]] = {n: [] for n in args.layers}
    for _ in range(args.repeats):
        for n in args.layers:
            times[n].append(compile_seconds(n))
    base = statistics.median(times[args.layers[0]])
    rows = [f"| layers | compile time (s, median) | ratio to {args.layers[0]} layers |", "|---:|---:|---:|"]
    for n in args.layers:
        med = statistics.median(times[n])
        rows.append(f"| {n} | {med:.2f} | {med / base:.2f} |")
    table = "\n".join(rows)
    print(table)
    command = "python benchmarks/compile.py " + " ".join(sys.argv[1:])
    body = (
        provenance(command.strip())
        + f"- step: configs/tiny.yaml (fsdp 4 x tensor 2, 8 simulated CPU devices), depth varied; "
        f"median of {args.repeats} fresh trace+lower+compile runs\n\n" + table + "\n\n"
        "Target: 16 layers within 1.5x of 2 layers (the layer stack is one `lax.scan`).\n"
    )
    update_section("compile", "Compile time vs depth (`benchmarks/compile.py`)", body)


if __name__ == "__main__":
    main()

"""How long training is blocked by a checkpoint save: async against synchronous.

Usage: python benchmarks/checkpoint.py [--model gpt2-small] [--saves 5]
Saves the train state of the model (parameters + AdamW moments, fp32) on one CPU device,
alternating async and synchronous saves into fresh directories, and reports the time the
caller is blocked: for async, until `save` returns (the state is copied off the devices,
writing continues in the background); for sync, until the checkpoint is on disk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax

from benchmarks.report import provenance, update_section
from spmd_train import Engine, load_config
from spmd_train.train.checkpoint import Checkpointer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-small")
    parser.add_argument("--saves", type=int, default=5)
    args = parser.parse_args()
    cfg = load_config(None, [f"model.preset={args.model}", "mesh.fsdp=1", "model.compute_dtype=float32"])
    engine = Engine.build(cfg, jax.devices()[:1])
    state = engine.init_state()
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    blocked = {"async": [], "sync": []}
    written = {"async": [], "sync": []}
    with tempfile.TemporaryDirectory() as root:
        for i in range(args.saves + 1):
            for mode in ("async", "sync"):
                ck = Checkpointer(Path(root) / f"{mode}{i}", async_save=mode == "async")
                start = time.perf_counter()
                ck.save(1, state, {"step": 1})
                returned = time.perf_counter()
                ck.wait()
                done = time.perf_counter()
                ck.close()
                if i:  # the first round warms up orbax and the file system
                    blocked[mode].append(returned - start)
                    written[mode].append(done - start)
    a, s = statistics.median(blocked["async"]), statistics.median(blocked["sync"])
    table = (
        "| save | training blocked (s, median) | until on disk (s, median) |\n|---|---:|---:|\n"
        f"| synchronous | {s:.3f} | {statistics.median(written['sync']):.3f} |\n"
        f"| async (default) | {a:.3f} | {statistics.median(written['async']):.3f} |\n"
        f"| **blocked time, async / sync** | **{a / s:.3f}** | |"
    )
    print(table)
    body = (provenance("python benchmarks/checkpoint.py " + " ".join(sys.argv[1:]))
            + f"- state: {args.model} preset, {engine.num_params:,} parameters, fp32 parameters + AdamW moments = "
            f"{nbytes / 2**20:.0f} MiB, one CPU device; {args.saves} alternating saves after one warm-up each\n\n"
            + table + "\n")
    update_section("checkpoint", "Checkpoint save: async vs synchronous (`benchmarks/checkpoint.py`)", body)


if __name__ == "__main__":
    main()

"""Host work off the step's critical path: the training loop with batches made ahead in a background thread
(`data.prefetch=2`, the default) against batches made by the loop when each step starts (`data.prefetch=0`).

Usage: python benchmarks/prefetch.py [--rounds 6] [--steps 60] [--config configs/tiny.yaml] [OVERRIDE ...]
Both variants run the same config through `Trainer.run` in alternating rounds (noise hits both alike),
each round a fresh run.dir with checkpoints off, after one warm-up round each; the first 5 steps of every
round are dropped (compilation is already cached; they still carry one-time costs). Reported per variant:
median step time, median `data_wait_s` (what the loop waited for its batch) and its share of the step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax

from benchmarks.report import provenance, update_section
from spmd_train import Trainer, load_config, simulate_devices

DROP = 5
"""Leading steps of a round left out of the medians."""


def one_round(config: str, overrides: list[str], prefetch: int, steps: int, folder: Path) -> list[dict]:
    """The step records of one fresh run of `steps` steps."""
    cfg = load_config(config, [*overrides, f"data.prefetch={prefetch}", f"train.steps={steps}",
                               "checkpoint.every=0", f"run.dir={folder}"])
    trainer = Trainer(cfg)
    try:
        trainer.run()
    finally:
        trainer.close()
    return trainer.history[DROP:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    simulate_devices(load_config(args.config, args.overrides).run.simulate_devices)
    variants = {"prefetch=2 (background thread)": 2, "prefetch=0 (loop makes each batch)": 0}
    records: dict[str, list[dict]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds + 1):
            for name, depth in variants.items():
                got = one_round(args.config, args.overrides, depth, args.steps, Path(tmp) / f"{depth}-{r}")
                if r:  # round 0 warms up (compilation cache, page cache)
                    records[name].extend(got)
    base = statistics.median(r["step_time_s"] for r in records["prefetch=0 (loop makes each batch)"])
    rows = ["| loop | step time (median) | vs prefetch=0 | data_wait_s (median) | share of the step |",
            "|---|---:|---:|---:|---:|"]
    for name, recs in records.items():
        step = statistics.median(r["step_time_s"] for r in recs)
        wait = statistics.median(r["data_wait_s"] for r in recs)
        rows.append(f"| {name} | {step * 1e3:.2f} ms | {step / base:.3f} | {wait * 1e3:.3f} ms | {wait / step:.2%} |")
    table = "\n".join(rows)
    print(table)
    command = "python benchmarks/prefetch.py " + " ".join(sys.argv[1:])
    update_section("prefetch", "Batches made ahead vs by the loop (`benchmarks/prefetch.py`)",
                   provenance(command.strip()) + f"- {args.rounds} alternating rounds of {args.steps} steps "
                   f"({args.config} {' '.join(args.overrides)}), first {DROP} of each dropped; "
                   f"{len(jax.devices())} devices\n\n" + table + "\n")


if __name__ == "__main__":
    main()

"""Host work off the step's critical path: the training loop with batches made ahead in a background thread
(`data.prefetch=2`, the default) against batches made by the loop when each step starts (`data.prefetch=0`).

Usage: python benchmarks/prefetch.py [--rounds 6] [--steps 60] [--config configs/tiny.yaml] [OVERRIDE ...]
Both variants run the same config through `Trainer.run` in alternating rounds (noise hits both alike),
each round a fresh run.dir with checkpoints off, after one warm-up round each; the first 5 steps of every
round are dropped (compilation is already cached; they still carry one-time costs). Reported per variant:
median step time, median `data_wait_s` (what the loop waited for its batch) and its share of the step.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax

from benchmarks.report import provenance, update_section
from benchmarks.rounds import DROP, alternating_rounds, round_parser


def main() -> None:
    args = round_parser(__doc__.splitlines()[0], rounds=6, steps=60).parse_args()
    records = alternating_rounds(args, {"prefetch=2 (background thread)": ["data.prefetch=2"],
                                        "prefetch=0 (loop makes each batch)": ["data.prefetch=0"]})
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

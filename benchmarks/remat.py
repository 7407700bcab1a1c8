"""What each rematerialisation policy costs on a small model: step time side by side, and the compiled
program's FLOPs, bytes moved and temporaries that explain it.

Usage: python benchmarks/remat.py [--rounds 4] [--steps 40] [--config configs/tiny.yaml] [OVERRIDE ...]
The policies run the same config through `Trainer.run` in alternating rounds (noise hits all alike), each
round a fresh run.dir with checkpoints off, after one warm-up round each; the first 5 steps of every round
are dropped. Reported per policy: median step time and its ratio to `full`, and from the compiled step
(XLA's cost analysis and memory analysis, per device): FLOPs, bytes accessed, temporaries, and the number
of [layers, ...] residual buffers the forward layer loop stacks for the backward pass (besides the weights).
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax

from benchmarks.report import provenance, update_section
from benchmarks.rounds import DROP, alternating_rounds, round_parser, run_config
from spmd_train import Trainer

POLICIES = ("none", "full", "save_matmuls")


def compiled_figures(config: str, overrides: list[str], policy: str, folder: Path) -> dict[str, float]:
    """Per-device FLOPs, bytes accessed and temporaries of the compiled step, and its stacked residuals."""
    trainer = Trainer(run_config(config, [*overrides, f"parallel.remat={policy}"], 1, folder))
    try:
        trainer.run()
        batch = trainer.data.batch(0, trainer.engine.batch_sharding)
        compiled = trainer.engine.train_step.lower(trainer.state, batch).compile()
    finally:
        trainer.close()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    layers = trainer.cfg.model.num_layers
    # The forward layer loop (the step's first while loop) carries the stacked layer weights and hands the
    # residuals autodiff keeps to the backward loop as more [layers, ...] buffers: the difference counts them.
    carried = [s for s in _forward_loop_shapes(compiled.as_text()) if s[:1] == (layers,)]
    weights = [path for path, _ in jax.tree_util.tree_flatten_with_path(trainer.state.params)[0]
               if "blocks" in jax.tree_util.keystr(path)]
    return {"flops": float(cost["flops"]), "bytes": float(cost["bytes accessed"]),
            "temp": float(compiled.memory_analysis().temp_size_in_bytes), "stacked": len(carried) - len(weights)}


def _forward_loop_shapes(hlo: str) -> list[tuple[int, ...]]:
    """The shapes in the tuple the step's first while loop (the forward layer scan) returns."""
    line = next(line for line in hlo.splitlines() if " while(" in line)
    signature = re.sub(r"/\*index=\d+\*/", "", line.split("= (", 1)[1].split(") while(", 1)[0])
    return [tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\w+\[([0-9,]*)\]", signature)]


def main() -> None:
    args = round_parser(__doc__.splitlines()[0], rounds=4, steps=40).parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        figures = {p: compiled_figures(args.config, args.overrides, p, Path(tmp) / p) for p in POLICIES}
    records = alternating_rounds(args, {p: [f"parallel.remat={p}"] for p in POLICIES})
    base = statistics.median(r["step_time_s"] for r in records["full"])
    full = figures["full"]
    rows = ["| parallel.remat | step time (median) | vs full | FLOPs / device | vs full | bytes accessed | vs full "
            "| temporaries | stacked residuals |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for policy, recs in records.items():
        step = statistics.median(r["step_time_s"] for r in recs)
        f = figures[policy]
        rows.append(f"| {policy} | {step * 1e3:.2f} ms | {step / base:.3f} | {f['flops']:.3g} | "
                    f"{f['flops'] / full['flops']:.2f} | {f['bytes'] / 1e6:.1f} MB | {f['bytes'] / full['bytes']:.2f} "
                    f"| {f['temp'] / 2**20:.2f} MiB | {f['stacked']} |")
    table = "\n".join(rows)
    print(table)
    command = "python benchmarks/remat.py " + " ".join(sys.argv[1:])
    update_section("remat", "Rematerialisation policies side by side (`benchmarks/remat.py`)",
                   provenance(command.strip()) + f"- {args.rounds} alternating rounds of {args.steps} steps "
                   f"({args.config} {' '.join(args.overrides)}), first {DROP} of each dropped; "
                   f"{len(jax.devices())} devices; compiled figures per device from XLA's cost and memory "
                   "analysis of the step\n\n" + table + "\n")


if __name__ == "__main__":
    main()

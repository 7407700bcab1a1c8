"""Side-by-side timing of training-loop variants: fresh runs of the same config in alternating rounds, so that
noise on a shared host hits every variant alike."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from spmd_train import Trainer, load_config, simulate_devices

DROP = 5
"""Leading steps of a round left out of the medians (compilation is cached by then; they still carry one-time
costs)."""


def round_parser(description: str, rounds: int, steps: int) -> argparse.ArgumentParser:
    """--rounds, --steps, --config and config overrides: what every alternating-rounds benchmark takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("overrides", nargs="*")
    return parser


def run_config(config: str, overrides: list[str], steps: int, folder: Path):
    """The config of one fresh run of `steps` steps in `folder`, checkpoints off."""
    return load_config(config, [*overrides, f"train.steps={steps}", "checkpoint.every=0", f"run.dir={folder}"])


def one_round(config: str, overrides: list[str], steps: int, folder: Path) -> list[dict]:
    """The step records of one fresh run, the first DROP left out."""
    trainer = Trainer(run_config(config, overrides, steps, folder))
    try:
        trainer.run()
    finally:
        trainer.close()
    return trainer.history[DROP:]


def alternating_rounds(args: argparse.Namespace, variants: dict[str, list[str]]) -> dict[str, list[dict]]:
    """Per variant (name -> its extra overrides), the step records of `args.rounds` rounds after a warm-up round."""
    simulate_devices(load_config(args.config, args.overrides).run.simulate_devices)
    records: dict[str, list[dict]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds + 1):
            for i, (name, extra) in enumerate(variants.items()):
                got = one_round(args.config, [*args.overrides, *extra], args.steps, Path(tmp) / f"{i}-{r}")
                if r:  # round 0 warms up (compilation cache, page cache)
                    records[name].extend(got)
    return records

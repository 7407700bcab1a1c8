"""XLA:CPU compile time and step time of the test suite's programs under candidate compiler options.

The suite compiles hundreds of tiny sharded train steps on 8 simulated CPU devices and runs each for a few steps, so
its wall time is mostly XLA:CPU compiling. This script lowers one train step per layout once, compiles it under each
option set side by side (same process, same lowered program) and runs each compiled step, so a flag goes into
`tests.runs.TEST_XLA_FLAGS` only with its measured gain and with the same loss to the last bit.

    python benchmarks/cpu_compile_flags.py            # three layouts: data x fsdp x tensor, a 2-stage pipeline, a ring
    python benchmarks/cpu_compile_flags.py --steps 0  # compile times only
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"  # no suite flags: each option set says its own
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax

from spmd_train import Engine, load_config
from spmd_train.data import make_source
from tests.runs import TINY

LAYOUTS = {
    "data2_fsdp2_tensor2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
    "pipeline2_1f1b": ["model.num_layers=8", "mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2",
                       "parallel.pipeline_schedule=1f1b"],
    "ring_sequence8": ["mesh.fsdp=1", "mesh.sequence=8", "parallel.context_parallel=ring"],
}
OPTIONS = {
    "O0": {"xla_backend_optimization_level": 0},
    "O0, elemental fusions": {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False},
    "O2": {"xla_backend_optimization_level": 2},
    "O2, elemental fusions": {"xla_backend_optimization_level": 2, "xla_cpu_use_fusion_emitters": False},
}


def measure(overrides: list[str], steps: int) -> None:
    """Print each option set's compile seconds, milliseconds per step and final loss for one layout."""
    cfg = load_config(None, [*TINY, *overrides])
    engine = Engine.build(cfg, jax.devices())
    data = make_source(cfg)
    lowered = engine.train_step.lower(engine.abstract_state(), engine.abstract_batch())
    for name, options in OPTIONS.items():
        start = time.perf_counter()
        compiled = lowered.compile(compiler_options=options)
        compile_s = time.perf_counter() - start
        line = f"  {name:<24} compile {compile_s:6.2f} s"
        if steps:
            state, metrics = compiled(engine.init_state(), data.batch(0, engine.batch_sharding))
            jax.block_until_ready(metrics)
            start = time.perf_counter()
            for step in range(1, steps + 1):
                state, metrics = compiled(state, data.batch(step, engine.batch_sharding))
            jax.block_until_ready(metrics)
            line += f"  step {(time.perf_counter() - start) / steps * 1e3:7.1f} ms  loss {float(metrics['loss']):.9f}"
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps timed after a warm-up step (0: compile only)")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), action="append", help="default: all")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {os.cpu_count()} CPU cores")
    for name in args.layout or LAYOUTS:
        print(name, flush=True)
        measure(LAYOUTS[name], args.steps)


if __name__ == "__main__":
    main()

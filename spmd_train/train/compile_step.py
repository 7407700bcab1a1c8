"""The train step compiled once per `Trainer`, refused when it does not fit, and kept as HLO text in run.dir."""

from __future__ import annotations

from pathlib import Path

import jax

from spmd_train.config.schema import Config
from spmd_train.data import TokenSource
from spmd_train.errors import ConfigError
from spmd_train.train.engine import Engine, TrainState
from spmd_train.train.memory_fit import check_compiled_fits


def compile_train_step(engine: Engine, data: TokenSource, state: TrainState, cfg: Config) -> jax.stages.Compiled:
    """The train step compiled for `state` and the data's batch shapes; a ConfigError when it cannot fit in device
    memory (the compiler's refusal, or the compiled program's own accounting)."""
    mesh = engine.mesh
    try:
        shapes = data.batch_shapes(engine.batch_sharding)  # no batch is made to compile
        compiled = engine.train_step.lower(state, shapes).compile()
        check_compiled_fits(compiled.memory_analysis(), mesh.devices.flat[0], cfg,
                            local_devices=len(mesh.local_devices))
    except jax.errors.JaxRuntimeError as err:
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        raise ConfigError(
            f"the train step does not fit in device memory when compiled ({str(err).splitlines()[0][:300]}) "
            f"for train.global_batch_size={cfg.train.global_batch_size} x train.seq_len="
            f"{cfg.train.seq_len}, train.grad_accum={cfg.train.grad_accum}, parallel.remat="
            f"{cfg.parallel.remat} (valid: a larger train.grad_accum, parallel.remat=full, a smaller "
            "batch or more devices on mesh.data / mesh.fsdp; `spmd-train describe` shows the step's memory)") from err
    return compiled


def write_program(compiled: jax.stages.Compiled, run_dir: Path) -> None:
    """The program the run ran, for inspection after the fact (collectives, fusions, memory): run.dir/compiled/."""
    out = run_dir / "compiled"
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_step.hlo.txt").write_text(compiled.as_text())

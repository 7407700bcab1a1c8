"""Shared test helpers: run a few optimizer steps through the public API, run the CLI, abstract state."""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from spmd_train import Engine, load_config
from spmd_train.data import make_source, prepare_data

ROOT = Path(__file__).resolve().parents[1]
FP32 = ["model.param_dtype=float32", "model.compute_dtype=float32"]
TINY = [
    "model.preset=tiny",
    "train.global_batch_size=32",
    "train.seq_len=16",
    "train.steps=3",
    "optim.warmup_steps=1",
    "optim.lr=1e-2",
]


def run_steps(overrides: list[str], devices, steps: int = 3, config: str | None = None, optimized: bool = False):
    """Train `steps` steps on `devices`; returns (per-step losses, final params as numpy, engine, state).

    Without `config` the tiny test setup (TINY) is the base; with it, that run config file is. `optimized`: the
    step compiled by XLA:CPU's optimizing backend (`OPTIMIZED`), for runs of hundreds of steps.
    """
    base = [] if config is not None else TINY
    cfg = load_config(ROOT / config if config else None, [*base, *overrides])
    engine = Engine.build(cfg, list(devices))
    state = engine.init_state()
    data = make_source(cfg)
    step_fn = optimized_step(engine, state, data) if optimized else engine.train_step
    losses = []
    for step in range(steps):
        state, metrics = step_fn(state, data.batch(step, engine.batch_sharding))
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.tree.map(np.asarray, state.params), engine, state


def tpu_step_hlo(overrides: list[str], topology: str) -> str:
    """The optimized HLO text of the tiny test model's train step (with `overrides`) compiled for a TPU `topology`
    (e.g. "v5e:2x4") through libtpu, without the persistent compilation cache."""
    from spmd_train.analysis.topology import tpu_topology_devices, without_persistent_cache

    engine = Engine.build(load_config(None, overrides), tpu_topology_devices(topology))
    with without_persistent_cache():
        return engine.train_step.lower(engine.abstract_state(), engine.abstract_batch()).compile().as_text()


def optimized_step(engine: Engine, state, data):
    """`engine`'s train step compiled for `state` and `data`'s batches by XLA:CPU's optimizing backend (`OPTIMIZED`)."""
    return engine.train_step.lower(state, data.batch(0, engine.batch_sharding)).compile(compiler_options=OPTIMIZED)


@contextlib.contextmanager
def optimized_compiles():
    """Every program compiled inside (a `Trainer`'s step, generation's) by XLA:CPU's optimizing backend
    (`OPTIMIZED`): for a test whose run of a hundred steps and more costs more than its compile."""
    plain = jax.stages.Lowered.compile

    def compile(self, compiler_options=None, **kwargs):
        return plain(self, compiler_options=compiler_options or OPTIMIZED, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jax.stages.Lowered, "compile", compile)
        yield


def relative_error(a, b) -> float:
    """Largest ||a - b|| / ||b|| over the leaves of two matching trees."""
    return max(
        float(np.linalg.norm(np.asarray(x, np.float64) - np.asarray(y, np.float64))
              / np.linalg.norm(np.asarray(y, np.float64)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


OPTIMIZED = {"xla_backend_optimization_level": 2, "xla_cpu_use_fusion_emitters": True}
"""Compiler options that put XLA:CPU's optimizing backend (-O2) back where a test runs a program long enough for it
to pay (a 600-step run: about 1.5x faster than at -O0), with XLA's own fusion emitters (steps 1.15x faster)."""

TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
"""XLA flags for every program the suite compiles (tests/conftest.py, and CLI subprocesses through `cli_env`).

XLA:CPU's LLVM backend at -O0: the suite's programs are tiny and take far longer to compile than to run (a
shipped-config equivalence file ran in 47 s instead of 81). What the tests compare is unchanged by it: the HLO,
its collectives and buffer assignment come before code generation, and the numbers each side of a comparison
computes come from programs compiled alike.

And XLA:CPU's elemental emitter for fusions instead of its MLIR fusion emitters, which own most of a small
program's compile time: a tiny model's sharded train step (data x fsdp x tensor, a 2-stage 1F1B pipeline, an 8-way
ring) compiles in 0.49-0.60x the time and steps 1.15-1.26x slower, a net gain for programs run a few steps; the
losses agree to float32 rounding (`benchmarks/cpu_compile_flags.py`). This one reaches the HLO: XLA:CPU expands
some ops before elemental fusion, which moved the pipeline config's temporary bytes by 0.1%, so the golden layouts
are recorded under these flags too (`tests/golden_layouts.py`)."""


def cli_env(optimized: bool = False) -> dict[str, str]:
    """The environment a CLI subprocess gets: ours, with the suite's XLA flags (none with `optimized`: XLA's
    defaults, for runs of hundreds of steps) instead of the test process's simulated-device settings."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return env if optimized else {**env, "XLA_FLAGS": TEST_XLA_FLAGS}


def uncached_env() -> dict[str, str]:
    """`cli_env` without the session's persistent compilation cache: for a test whose step must really compile,
    or whose processes must take equally long to start (one loading its step from the cache while its peer
    compiles looks like a stall to the step watchdog)."""
    return {k: v for k, v in cli_env().items() if k != "JAX_COMPILATION_CACHE_DIR"}


def cli(*args: str, cwd: Path = ROOT, timeout: int = 600, optimized: bool = False) -> subprocess.CompletedProcess:
    """`python -m spmd_train ARGS` in a fresh process, output captured as text (`optimized`: see `cli_env`)."""
    return subprocess.run([sys.executable, "-m", "spmd_train", *args], cwd=cwd, env=cli_env(optimized),
                          capture_output=True, text=True, timeout=timeout, check=False)


def main_in_process(*args: str, capsys, cwd: Path = ROOT) -> tuple[int, str, str]:
    """`spmd-train ARGS` through the CLI's `main()` in this process: (exit code, stdout, stderr).

    For refusals and other runs that prove nothing a fresh process would add: a subprocess costs an interpreter and
    a jax import. Relative paths resolve against `cwd` (the repository, as `cli`'s do); the process-wide set-up
    `main()` makes (SIGINT handler, unraisable hook, the `spmd_train` log handler on captured stderr) is undone
    afterwards.
    """
    import logging
    import signal

    from spmd_train.cli.main import main

    logger = logging.getLogger("spmd_train")
    saved = (signal.getsignal(signal.SIGINT), sys.unraisablehook, list(logger.handlers), logger.level,
             logger.propagate, os.getcwd())
    capsys.readouterr()
    os.chdir(cwd)
    try:
        code = main(list(args))
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code
    finally:
        signal.signal(signal.SIGINT, saved[0])
        sys.unraisablehook = saved[1]
        logger.handlers[:] = saved[2]
        logger.setLevel(saved[3])
        logger.propagate = saved[4]
        os.chdir(saved[5])
    out, err = capsys.readouterr()
    return code, out, err


def abstract_like(shapes, shardings):
    """ShapeDtypeStructs of a tree of shapes, each carrying its sharding (for lowering without arrays)."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def token_files(path: str) -> list[str]:
    """Overrides that train on the byte token file at `path`, all of it (no held-out split).

    prepare-data's byte ids run to 256 (end of text): the model needs 257 rows at least, 264 divides by 8.
    """
    return ["data.source=tokens", f"data.paths=[{path}]", "data.val_fraction=0.0", "model.vocab_size=264"]


def write_corpus(folder, lengths, seed=0):
    """prepare-data over byte documents of the given lengths; returns the .bin path and the documents."""
    rng = np.random.default_rng(seed)
    docs = [bytes(rng.integers(97, 123, n, dtype=np.uint8)).decode() for n in lengths]
    for i, text in enumerate(docs):
        (folder / f"doc{i}.txt").write_text(text)
    return prepare_data([folder / f"doc{i}.txt" for i in range(len(docs))], folder / "out"), docs


def tpu_attention_flops(seq_len: int, extra: list[str]) -> tuple[float, float]:
    """(compiled attention FLOPs inside our Pallas kernels, the model's attention FLOPs) per device of a 2-head,
    256-wide tiny model compiled for v5e:2x2 in 512 x 512 blocks at `seq_len` tokens, with `extra` overrides."""
    from spmd_train.analysis import describe

    cfg = load_config(None, ["model.preset=tiny", "model.d_model=256", "model.num_heads=2", "model.num_kv_heads=2",
                             f"train.seq_len={seq_len}", "train.global_batch_size=4", "mesh.fsdp=4", "mesh.tensor=1",
                             "backends.attention=pallas", "backends.attention_blocks=[512,512]", *extra])
    d = describe(cfg, topology="v5e:2x2").per_device
    return d["attention_flops"], d["model_attention_flops"]


def tensorboard_events(run_dir) -> list:
    """Every event of the run's TensorBoard files, in the order written (TFRecord frames of `Event` protos)."""
    from tensorboardX.proto.event_pb2 import Event

    events = []
    for path in sorted((run_dir / "tensorboard").iterdir(), key=lambda p: (p.stat().st_mtime_ns, p.name)):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = Event()
            event.ParseFromString(data[i + 12:i + 12 + n])  # length, its CRC, the record, its CRC
            events.append(event)
            i += 12 + n + 4
    return events

"""`Trainer`: the one object notebooks and the CLI drive a run through.

    trainer = Trainer(load_config("configs/tiny.yaml"))
    trainer.init()           # resume from run.dir, or start from checkpoint.load_from, or fresh
    trainer.run(100)         # steps, metrics, periodic async checkpoints, a final save
    trainer.history          # one dict per step

Where a run starts is `startup`'s, compiling the step `compile_step`'s, stepping `run_loop`'s.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from spmd_train.config.schema import Config
from spmd_train.console_log import log_to_stderr
from spmd_train.data import Batch, make_source
from spmd_train.devices import simulate_devices
from spmd_train.errors import ConfigError, TrainingHalted
from spmd_train.hardware import device_spec
from spmd_train.models.flops import flops_per_token
from spmd_train.output_dir import make_output_dir
from spmd_train.train import run_lock
from spmd_train.train.checkpoint import Checkpointer
from spmd_train.train.compile_step import compile_train_step, write_program
from spmd_train.train.engine import Engine, TrainState
from spmd_train.train.generation import GenerateResult, generate
from spmd_train.train.memory_fit import activation_floor, check_batch_fits, check_state_fits, describe_run
from spmd_train.train.metrics import MetricsSink
from spmd_train.train.param_sharding import show_param_sharding
from spmd_train.train.restore import restore_latest
from spmd_train.train.run_loop import RunLoop
from spmd_train.train.startup import record_start, starting_state
from spmd_train.train.wandb_run import WandbRun, require_wandb
from spmd_train.train.watchdog import StepWatchdog


class Trainer(RunLoop):
    """A model, its data, its state and its run directory."""

    def __init__(self, cfg: Config, devices: list[jax.Device] | None = None):
        self.cfg = cfg
        if cfg.run.wandb:
            require_wandb()  # refused before a compile or a file, not after
        if devices is None:
            simulate_devices(cfg.run.simulate_devices)  # a no-op once jax has started (the CLI did it)
        self.engine = Engine.build(cfg, devices)
        device, local = self.engine.mesh.devices.flat[0], len(self.engine.mesh.local_devices)
        check_state_fits(self.engine.state_bytes_per_device, device, describe_run(cfg, dict(self.engine.mesh.shape)),
                         allocating=True, local_devices=local)
        shard = self.engine.batch_sharding.shard_shape((cfg.train.global_batch_size, cfg.train.seq_len + 1))
        check_batch_fits(self.engine.state_bytes_per_device, activation_floor(cfg, shard, dict(self.engine.mesh.shape)),
                         device, cfg, local_devices=local)
        self.data = make_source(cfg)
        self.run_dir = Path(cfg.run.dir)
        self.history: list[dict[str, Any]] = []
        self.expert_balance: dict[str, np.ndarray] | None = None
        """The last step's per-expert vectors with MoE layers (`train.balance.balance_vectors`: `expert_load` and
        `router_bias`, [MoE layers, experts] in model order); None before a step or without MoE."""
        self.state: TrainState | None = None
        self.compile_time_s: float | None = None
        self._compiled = None
        self._checkpointer: Checkpointer | None = None
        self._stop_signal: str | None = None
        self._halted: str | None = None
        self._lock: Path | None = None
        self._watchdog = StepWatchdog(cfg.run.peer_timeout_s, active=False)
        self._step_sink: MetricsSink | None = None
        self._created_dir = False
        log_to_stderr()  # a script's run says its steps too (plain lines where stderr is no terminal)
        self._wandb: WandbRun | None = None
        kind = self.engine.mesh.devices.flat[0].device_kind
        spec = device_spec(kind)
        peak = cfg.run.peak_tflops * 1e12 if cfg.run.peak_tflops else (spec.peak_bf16_flops if spec else None)
        self.peak_flops_per_device: float | None = peak
        self.flops_per_token = flops_per_token(cfg.model, cfg.train.seq_len)

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """The device mesh the run uses."""
        return self.engine.mesh

    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far."""
        return int(self.state.step) if self.state is not None else 0

    @property
    def checkpointer(self) -> Checkpointer:
        """The run directory's checkpoint manager (created on first use)."""
        if self._checkpointer is None:
            ck = self.cfg.checkpoint
            self._checkpointer = Checkpointer(self.run_dir / "checkpoints", keep=ck.keep, async_save=ck.async_save)
        return self._checkpointer

    def init(self) -> TrainState:
        """Resume from run.dir's latest checkpoint, else start from checkpoint.load_from, else fresh.

        Refused input (ConfigError) leaves nothing behind: a run.dir this call created is removed again.
        """
        self._created_dir = make_output_dir(self.run_dir, f"run.dir={self.run_dir}")
        try:
            return self._init()
        except ConfigError as err:
            self._refused(err)

    def _refused(self, err: ConfigError) -> None:
        """Raise `err`, first removing the run.dir `init` created if nothing was saved in it yet."""
        if self._created_dir and jax.process_index() == 0 and not self.checkpointer.steps():
            self.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)
        raise err

    def _init(self) -> TrainState:
        if self._lock is None and jax.process_index() == 0:  # one writer per run.dir (released by close())
            self._lock = run_lock.acquire(self.run_dir)
        self.state, self.history = starting_state(self.engine, self.cfg, self.checkpointer, self.run_dir, self._say)
        if jax.process_index() == 0:
            record_start(self.engine, self.cfg, self.run_dir, self.step_count, self._say)
        self._say(f"backends: {self.engine.backends.describe()}")
        return self.state

    def compile(self) -> None:
        """Compile the train step once (timed apart from training); keep its HLO in run.dir/compiled/."""
        if self._compiled is None:
            start = time.perf_counter()
            try:
                compiled = compile_train_step(self.engine, self.data, self.state, self.cfg)
            except ConfigError as err:
                self._refused(err)
            self._compiled = compiled
            self.compile_time_s = time.perf_counter() - start
            if jax.process_index() == 0:
                write_program(self._compiled, self.run_dir)

    def save(self, wait: bool = False) -> None:
        """Checkpoint the current state (async unless `wait` or checkpoint.async_save=false); never a non-finite one.

        A step already saved (or being saved) is not saved again: `run()` saves its last step itself.
        """
        if self.checkpointer.has(self.step_count):
            if wait:
                self.checkpointer.wait()
            return
        with self._watchdog.paused():  # copying the state off the devices, Orbax's barriers: no step in them
            self._save(wait)

    def _save(self, wait: bool) -> None:
        finite, prints = jax.device_get(self.engine.state_health(self.state))
        if not finite:
            raise TrainingHalted(
                f"not saving step {self.step_count}: its parameters or optimizer state hold non-finite values; "
                f"the checkpoints in {self.run_dir / 'checkpoints'} (steps {self.checkpointer.steps()}) are untouched")
        meta = {**self.engine.checkpoint_meta(self.step_count), "fingerprint": prints.tolist()}
        self.checkpointer.save(self.step_count, self.state, meta)
        if wait:
            self.checkpointer.wait()

    def restore(self, path: str | Path | None = None) -> TrainState:
        """Restore the latest checkpoint of this run (or of another run directory) onto this mesh."""
        source = Checkpointer(Path(path) / "checkpoints", read_only=True) if path else self.checkpointer
        restored = restore_latest(self.engine, self.cfg, source, Path(path or self.run_dir))
        if restored is None:
            raise ConfigError(f"no checkpoint found in {source.directory}")
        self.state = restored[1]
        return self.state

    def evaluate(self, batches: int | None = None) -> float:
        """Mean loss of the current parameters on the held-out split (`train.eval_batches` fixed batches)."""
        self._ensure_ready()
        batches = batches or self.cfg.train.eval_batches
        total = 0.0
        for i in range(batches):
            # One program in flight at a time (XLA:CPU's collectives on simulated devices).
            total += float(self.engine.eval_step(self.state.params,
                                                 self.data.batch(i, self.engine.batch_sharding, split="val")))
        return total / batches

    def generate(self, prompts: list[list[int]], **kw) -> GenerateResult:
        """New tokens for each prompt (token ids) from the current parameters, with a KV cache; starts or resumes the
        run first if it has no state. Keywords as `train.generation.generate` (max_new_tokens, temperature, top_k,
        top_p, seed, stop_ids)."""
        if self.state is None:
            self.init()
        return generate(self.engine, self.state.params, prompts, **kw)

    def describe(self):
        """The compiled-step report of `spmd-train describe` for this run's config and mesh."""
        from spmd_train.analysis import describe

        return describe(self.cfg, devices=list(self.mesh.devices.flat))

    def show_sharding(self, name: str) -> None:
        """Draw which device holds which part of a parameter, by path ('embedding', 'blocks.mlp.w_up').

        jax draws 1-D and 2-D arrays: stacked layer weights show layer 0, and trailing axes are
        folded into the last so the split axes stay visible.
        """
        self._ensure_ready()
        show_param_sharding(self.state.params, name)

    def close(self) -> None:
        """Wait for pending checkpoint writes and release resources (the run directory's lock last)."""
        self._close_step_sink()
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None
        if self._lock is not None:
            run_lock.release(self._lock)
            self._lock = None

    # -- internals ---------------------------------------------------------------------------

    def _ensure_ready(self) -> None:
        if self.state is None:
            self.init()
        self.compile()

    def _batch(self, step: int) -> Batch:
        return self.data.batch(step, self.engine.batch_sharding)

    def _say(self, message: str) -> None:
        if jax.process_index() == 0:
            logging.getLogger("spmd_train").info(message)

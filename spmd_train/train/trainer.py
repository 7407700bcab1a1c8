"""`Trainer`: the one object notebooks and the CLI drive a run through.

    trainer = Trainer(load_config("configs/tiny.yaml"))
    trainer.init()           # resume from run.dir, or start from checkpoint.load_from, or fresh
    trainer.run(100)         # steps, metrics, periodic async checkpoints, a final save
    trainer.history          # one dict per step
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import shutil
import signal
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from spmd_train.config.hf_config import hf_directory
from spmd_train.config.schema import Config
from spmd_train.data import Batch, make_source
from spmd_train.devices import simulate_devices
from spmd_train.errors import ConfigError, TrainingHalted
from spmd_train.hardware import device_spec
from spmd_train.hf.run import import_hf
from spmd_train.models.flops import flops_per_token
from spmd_train.output_dir import make_output_dir
from spmd_train.train import interrupts, run_lock
from spmd_train.train.capacity import (
    activation_floor,
    check_batch_fits,
    check_compiled_fits,
    check_state_fits,
    describe_run,
)
from spmd_train.train.checkpoint import Checkpointer
from spmd_train.train.engine import Engine, TrainState
from spmd_train.train.generate import GenerateResult, generate
from spmd_train.train.guards import halt_reason
from spmd_train.train.metrics import MetricsSink, read_history, step_record
from spmd_train.train.prefetch import Prefetcher
from spmd_train.train.restore import load_from_source, restore_latest
from spmd_train.train.run_record import record_config
from spmd_train.train.wandb_run import WandbRun
from spmd_train.train.watchdog import StepWatchdog


class Trainer:
    """A model, its data, its state and its run directory."""

    def __init__(self, cfg: Config, devices: list[jax.Device] | None = None):
        self.cfg = cfg
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
        existing = self.checkpointer.steps()
        if existing and self.cfg.train.resume == "never":
            raise ConfigError(f"run.dir={self.run_dir} already has checkpoints (steps {existing}) and "
                              "train.resume=never (valid: train.resume=auto to continue it, or a new run.dir)")
        chosen = self.cfg.train.resume_step
        if chosen is not None and chosen not in existing:
            raise ConfigError(f"train.resume_step={chosen}: {self.run_dir / 'checkpoints'} has no complete checkpoint "
                              f"at that step (valid: one of {existing})" if existing else
                              f"train.resume_step={chosen}: {self.run_dir} has no checkpoints to resume from "
                              "(valid: train.resume_step=null to start fresh)")
        restored = (restore_latest(self.engine, self.cfg, self.checkpointer, self.run_dir, only=chosen)
                    if existing else None)
        if restored is not None:
            step, self.state = restored
            for aside in self.checkpointer.supersede_after(step):
                self._say(f"train.resume_step={step}: moved the newer checkpoint {aside.name} to {aside.parent}")
            self.history = read_history(self.run_dir / "metrics.jsonl", step)
            self._say(f"resumed from {self.run_dir / 'checkpoints'} at step {step}")
        elif (hf := hf_directory(self.cfg.checkpoint.load_from)) is not None:
            self.state = self.engine.state_from_params(import_hf(self.engine, hf, self.run_dir))
            self.history = read_history(self.run_dir / "metrics.jsonl", 0)
            self._say(f"started from the Hugging Face checkpoint {hf}")
        else:
            self.state = self.engine.init_state()
            self.history = read_history(self.run_dir / "metrics.jsonl", 0)
            if self.cfg.checkpoint.load_from:
                self._load_weights(Path(self.cfg.checkpoint.load_from))
        if jax.process_index() == 0:
            # The config as given, then what the engine derived from it (ignored when the file is loaded).
            record = {**asdict(self.cfg), "resolved": self.engine.resolved()}
            changes = record_config(self.run_dir, record, self.step_count)
            if changes:
                self._say("config changed since the last start (recorded in config_changes.jsonl): "
                          + ", ".join(f"{k}: {b!r} -> {a!r}" for k, (b, a) in list(changes.items())[:8])
                          + (f" and {len(changes) - 8} more" if len(changes) > 8 else ""))
        self._say(f"backends: {self.engine.backends.describe()}")
        return self.state

    def compile(self) -> None:
        """Compile the train step once (timed apart from training); keep its HLO in run.dir/compiled/."""
        if self._compiled is None:
            start = time.perf_counter()
            try:
                shapes = self.data.batch_shapes(self.engine.batch_sharding)  # no batch is made to compile
                compiled = self.engine.train_step.lower(self.state, shapes).compile()
                check_compiled_fits(compiled.memory_analysis(), self.mesh.devices.flat[0], self.cfg,
                                    local_devices=len(self.mesh.local_devices))
            except jax.errors.JaxRuntimeError as err:
                if "RESOURCE_EXHAUSTED" not in str(err):
                    raise
                self._refused(ConfigError(
                    f"the train step does not fit in device memory when compiled ({str(err).splitlines()[0][:300]}) "
                    f"for train.global_batch_size={self.cfg.train.global_batch_size} x train.seq_len="
                    f"{self.cfg.train.seq_len}, train.grad_accum={self.cfg.train.grad_accum}, parallel.remat="
                    f"{self.cfg.parallel.remat} (valid: a larger train.grad_accum, parallel.remat=full, a smaller "
                    "batch or more devices on mesh.data / mesh.fsdp; `spmd-train describe` shows the step's memory)"))
            except ConfigError as err:
                self._refused(err)
            self._compiled = compiled
            self.compile_time_s = time.perf_counter() - start
            if jax.process_index() == 0:
                # The program the run ran, for inspection after the fact (collectives, fusions, memory).
                out = self.run_dir / "compiled"
                out.mkdir(parents=True, exist_ok=True)
                (out / "train_step.hlo.txt").write_text(self._compiled.as_text())

    def step(self) -> dict[str, Any]:
        """One optimizer step, synchronously; returns (and records) its metrics."""
        self._ensure_ready()
        start, index = time.perf_counter(), self.step_count
        batch = self._batch(index)
        waited = time.perf_counter() - start
        self.state, metrics = self._compiled(self.state, batch)
        record = self._record(index, jax.device_get(metrics), time.perf_counter() - start, waited)
        self.history.append(record)
        if self._step_sink is None:  # records of step() reach metrics.jsonl like those of run()
            self._step_sink = MetricsSink(self.run_dir, total_steps=self.cfg.train.steps,
                                          log_every=self.cfg.run.log_every, start_step=index, progress=False,
                                          mirrors=self._mirrors())
        self._step_sink.write(record)
        self._judge(record)
        if self._halted:
            raise TrainingHalted(self._halted)
        return record

    def run(self, steps: int | None = None) -> list[dict[str, Any]]:
        """Train up to `train.steps` (or `steps` more), checkpointing as configured; returns the new records."""
        if self.state is None:
            self.init()
        first = self.step_count
        last = min(self.cfg.train.steps, first + steps) if steps is not None else self.cfg.train.steps
        if first >= last:  # a finished run: nothing to compile
            self._say(f"nothing to do: the run is at step {first} and train.steps={self.cfg.train.steps}")
            return []
        self.compile()
        interrupts.raise_if_interrupted()  # a Ctrl-C the compiler swallowed still stops the run here
        self._close_step_sink()  # one writer of metrics.jsonl at a time
        sink = MetricsSink(self.run_dir, total_steps=self.cfg.train.steps, log_every=self.cfg.run.log_every,
                           start_step=first, mirrors=self._mirrors())
        sink.note("compiled the train step in %.2f s", self.compile_time_s)
        if self.data.loss_floor is not None:
            sink.note("best achievable loss on this data: %.4f nats/token", self.data.loss_floor)
        new: list[dict[str, Any]] = []
        every = self.cfg.checkpoint.every
        profile = self.cfg.run.profile_steps
        self._halted = None
        batches = Prefetcher(self._batch, first, last, depth=self.cfg.data.prefetch)
        with self._signals(), contextlib.closing(sink), _trace_closed(), self._watching(first), batches:
            pending, done_at = None, time.perf_counter()
            for index in range(first, last):
                if profile and index + 1 == profile[0]:
                    jax.profiler.start_trace(str(self.run_dir / "profile"))
                batch, waited = batches.take(index)
                with self._watchdog.waiting():  # a dispatch may block on the step before it
                    self.state, metrics = self._compiled(self.state, batch)
                if pending is not None:  # at most one step in flight: finish the previous one now
                    done_at = self._finish(pending, done_at, sink, new)
                pending = (index + 1, metrics, waited)
                if self.cfg.train.eval_every and (index + 1) % self.cfg.train.eval_every == 0:
                    # Finish this step now so its record gets the loss of exactly these parameters.
                    done_at = self._finish(pending, done_at, sink, new, evaluate=True)
                    pending = None
                if self._halted:  # nothing more is saved: the last checkpoint stays the newest
                    pending = None
                    break
                if profile and index + 1 == profile[1]:
                    jax.block_until_ready(metrics)
                    jax.profiler.stop_trace()
                if self._stop_signal:
                    self.save()
                elif every and (index + 1) % every == 0:
                    self._periodic_save(sink)
                if self._stop_signal:
                    break
            if pending is not None:
                self._finish(pending, done_at, sink, new)
            if self._halted:
                sink.note("%s", self._halted)
            elif self._stop_signal:
                sink.note("stopped by %s after step %d; checkpoint saved in %s", self._stop_signal,
                          self.step_count, self.run_dir / "checkpoints")
            elif new:
                self.save()  # a no-op when the last step was saved periodically
            with self._watchdog.paused():
                self.checkpointer.wait()
        if self._halted:
            raise TrainingHalted(self._halted)
        return new

    @property
    def stopped_by_signal(self) -> str | None:
        """'SIGTERM' or 'SIGINT' when the last `run` ended early on a signal."""
        return self._stop_signal

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
        run first if it has no state. Keywords as `train.generate.generate` (max_new_tokens, temperature, top_k, top_p,
        seed)."""
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
        leaf = self.state.params
        for part in name.split("."):
            if not isinstance(leaf, dict) or part not in leaf:
                names = _dotted_paths(self.state.params)
                close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
                raise ConfigError(f"show_sharding({name!r}): no such parameter"
                                  + (f"; did you mean {', '.join(map(repr, close))}?" if close else "")
                                  + f" (valid: {', '.join(names)})")
            leaf = leaf[part]
        if name.startswith("blocks."):
            leaf = leaf[0]
        if leaf.ndim > 2:
            leaf = leaf.reshape(leaf.shape[0], -1)
        jax.debug.visualize_array_sharding(leaf)

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

    def _close_step_sink(self) -> None:
        if self._step_sink is not None:
            self._step_sink.close()
            self._step_sink = None

    def _mirrors(self) -> tuple[WandbRun, ...]:
        """Where step records go besides metrics.jsonl and TensorBoard: the W&B run, started once per Trainer."""
        if not self.cfg.run.wandb or jax.process_index() != 0:
            return ()
        if self._wandb is None:
            self._wandb = WandbRun(self.cfg.run, self.run_dir, asdict(self.cfg))
        return (self._wandb,)

    def _ensure_ready(self) -> None:
        if self.state is None:
            self.init()
        self.compile()

    def _batch(self, step: int) -> Batch:
        return self.data.batch(step, self.engine.batch_sharding)

    def _load_weights(self, path: Path) -> None:
        """checkpoint.load_from: a run.dir (its latest checkpoint), its checkpoints/ or one checkpoints/STEP."""
        source, run_dir, step = load_from_source(path, self.cfg.checkpoint.load_from)
        done, restored = restore_latest(self.engine, self.cfg, source, run_dir, same_run=False, only=step)
        self.state = self.state._replace(params=restored.params)
        self._say(f"started from the parameters of step {done} in {run_dir / 'checkpoints'}")

    def _finish(self, pending, done_at: float, sink: MetricsSink, new: list, evaluate: bool = False) -> float:
        step, metrics, waited = pending
        with self._watchdog.waiting():
            values = jax.device_get(metrics)  # blocks until that step is done
        self._watchdog.finished(step)
        now = time.perf_counter()
        record = self._record(step - 1, values, now - done_at, waited)
        if evaluate:  # after the step's timing: evaluation time is not step time
            with self._watchdog.paused():
                record["val_loss"] = self.evaluate()
            now = time.perf_counter()
        self.history.append(record)
        new.append(record)
        sink.write(record)
        if record["skipped"]:
            sink.note("step %d skipped (%s): loss %.6g, grad_norm %.6g; %d skipped in a row, %d in all",
                      record["step"], record["skip_reason"], record["loss"], record["grad_norm"],
                      record["consecutive_skips"], record["skipped_steps"])
        self._judge(record)
        return now

    def _periodic_save(self, sink: MetricsSink) -> None:
        """checkpoint.every's save, unless the step came in a run of skipped ones.

        Its parameters are then those of the last applied step, which is often what made the
        run diverge; saving it would rotate good checkpoints out for copies of one suspect state.
        """
        with self._watchdog.waiting():
            skipping = int(self.state.guard.consecutive)  # waits for the step in flight, as the save would
        if skipping:
            sink.note("not saving step %d: it ends a run of %d skipped steps", self.step_count, skipping)
            return
        self.save()

    def _judge(self, record: dict[str, Any]) -> None:
        """Decide from a finished step whether the run must stop (sets `_halted` to the message)."""
        self._halted = halt_reason(record, self.cfg.train, self.checkpointer.steps()) or self._halted

    def _record(self, index: int, metrics, seconds: float, data_wait: float) -> dict[str, Any]:
        return step_record(index, metrics, seconds=seconds, data_wait=data_wait, cfg=self.cfg, mesh=self.mesh,
                           flops_per_token=self.flops_per_token, peak_flops=self.peak_flops_per_device,
                           loss_floor=self.data.loss_floor)

    @contextlib.contextmanager
    def _watching(self, first: int):
        """The step watchdog for this `run` (multi-process runs only: see train/watchdog.py)."""
        if jax.process_count() == 1:
            yield
            return
        self._watchdog = StepWatchdog(self.cfg.run.peer_timeout_s, process=jax.process_index(),
                                      client=ocp.multihost.get_jax_distributed_client()).start(first)
        try:
            yield
        finally:
            self._watchdog.close()
            self._watchdog = StepWatchdog(self.cfg.run.peer_timeout_s, active=False)

    @contextlib.contextmanager
    def _signals(self):
        self._stop_signal = None
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def stop(signum, _frame):
            self._stop_signal = signal.Signals(signum).name

        previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _say(self, message: str) -> None:
        if jax.process_index() == 0:
            logging.getLogger("spmd_train").info(message)


def _dotted_paths(tree: dict, prefix: str = "") -> list[str]:
    """'blocks.mlp.w_up' for every leaf of a nested dict of parameters."""
    out = []
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        out.extend(_dotted_paths(value, path) if isinstance(value, dict) else [path])
    return out


@contextlib.contextmanager
def _trace_closed():
    """Stop a profiler trace the loop started if the run ends before its last profiled step."""
    try:
        yield
    finally:
        with contextlib.suppress(RuntimeError):  # raised when no trace is active
            jax.profiler.stop_trace()

"""The steps of a `Trainer`: `step` and `run`, the records they write, the saves they make and what stops them.

`RunLoop` is mixed into `Trainer`: it drives the attributes listed on it and calls `Trainer`'s init, compile,
save, evaluate, checkpointer, step_count, mesh, _ensure_ready, _batch and _say.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from spmd_train.config.schema import Config
from spmd_train.data import TokenSource
from spmd_train.errors import ConfigError, TrainingHalted
from spmd_train.train import interrupts
from spmd_train.train.engine import Engine, TrainState
from spmd_train.train.guards import halt_reason
from spmd_train.train.metrics import MetricsSink, step_record
from spmd_train.train.prefetch import Prefetcher
from spmd_train.train.wandb_run import WandbRun
from spmd_train.train.watchdog import StepWatchdog


class RunLoop:
    """`Trainer.step` and `Trainer.run`, with the step records, periodic saves, halting and signals they involve."""

    cfg: Config
    engine: Engine
    data: TokenSource
    run_dir: Path
    history: list[dict[str, Any]]
    expert_balance: dict[str, np.ndarray] | None
    state: TrainState | None
    flops_per_token: float
    peak_flops_per_device: float | None
    compile_time_s: float | None
    _compiled: Any
    _stop_signal: str | None
    _halted: str | None
    _watchdog: StepWatchdog
    _step_sink: MetricsSink | None
    _wandb: WandbRun | None

    def step(self) -> dict[str, Any]:
        """One optimizer step, synchronously; returns (and records) its metrics."""
        self._ensure_ready()
        start, index = time.perf_counter(), self.step_count
        batch = self._batch(index)
        waited = time.perf_counter() - start
        self.state, metrics = self._compiled(self.state, batch)
        values = jax.device_get(metrics)
        histograms = self._take_histograms(values)
        record = self._record(index, values, time.perf_counter() - start, waited)
        self.history.append(record)
        if self._step_sink is None:  # records of step() reach metrics.jsonl like those of run()
            self._step_sink = MetricsSink(self.run_dir, total_steps=self.cfg.train.steps,
                                          log_every=self.cfg.run.log_every, start_step=index, progress=False,
                                          mirrors=self._mirrors())
        self._step_sink.write(record, histograms)
        self._judge(record)
        if self._halted:
            raise TrainingHalted(self._halted)
        return record

    def run(self, steps: int | None = None) -> list[dict[str, Any]]:
        """Train up to `train.steps` (or `steps` more), checkpointing as configured; returns the new records."""
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ConfigError(f"Trainer.run(steps={steps!r}): steps is how many more steps to train (valid: an "
                              "integer >= 1, or None for up to train.steps)")
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
                pass  # said once, by the TrainingHalted raised below (the CLI prints it; a script sees it raised)
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

    def _finish(self, pending, done_at: float, sink: MetricsSink, new: list, evaluate: bool = False) -> float:
        step, metrics, waited = pending
        with self._watchdog.waiting():
            values = jax.device_get(metrics)  # blocks until that step is done
        self._watchdog.finished(step)
        now = time.perf_counter()
        histograms = self._take_histograms(values)
        record = self._record(step - 1, values, now - done_at, waited)
        if evaluate:  # after the step's timing: evaluation time is not step time
            with self._watchdog.paused():
                record["val_loss"] = self.evaluate()
            now = time.perf_counter()
        self.history.append(record)
        new.append(record)
        sink.write(record, histograms)
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

    def _take_histograms(self, values: dict[str, Any]) -> dict[str, np.ndarray] | None:
        """Pop the step's per-expert vectors (`balance.balance_vectors`) from its fetched metrics; kept as
        `expert_balance`."""
        histograms = values.pop("histograms", None)
        if histograms is not None:
            self.expert_balance = {k: np.asarray(v) for k, v in histograms.items()}
        return self.expert_balance if histograms is not None else None

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


@contextlib.contextmanager
def _trace_closed():
    """Stop a profiler trace the loop started if the run ends before its last profiled step."""
    try:
        yield
    finally:
        with contextlib.suppress(RuntimeError):  # raised when no trace is active
            jax.profiler.stop_trace()

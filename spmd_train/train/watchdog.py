"""Step watchdog: a multi-process run whose steps stop finishing ends, naming who is stuck, instead of hanging.

JAX's coordination service catches a process that dies or freezes: it stops sending heartbeats
(`run.peer_timeout_s`, see `devices.start_distributed`). It cannot see a process whose heartbeat
thread lives while its main thread hangs (a stuck file read, a deadlock in user code): the others
then wait in the next step's collectives forever. This thread catches that case. Each process
publishes the last step it finished in JAX's key-value store (through Orbax's public handle on the
distributed client). The first process to see no step
finish for the limit declares the run stalled there; every process then writes what it knows and
stops with exit 3 (or is ended by JAX's service once the first has gone): a process stuck outside
the step names itself and where its main thread is, one waiting for a step names the processes
that finished fewer steps than it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from spmd_train.train.prefetch import PREFETCH_THREAD

EXIT_STALLED = 3
"""The exit code of a stalled process (as for a run the step guards stop)."""
SLOWEST_STEP_FACTOR = 10
"""A step counts as stalled after this many times the slowest step so far (when longer than twice the timeout)."""
_KEY = "spmd_train/finished/"
_STALLED = "spmd_train/stalled"


class StepWatchdog:
    """Ends the process when no step finishes for max(2 x timeout, 10 x the slowest step), outside paused phases."""

    def __init__(self, timeout_s: float, *, process: int = 0, client: Any = None,
                 stop: Callable[[int], None] = os._exit, active: bool = True):
        self.timeout_s, self.process, self.client, self._stop = timeout_s, process, client, stop
        self.active = active
        self.message: str | None = None
        """What the watchdog said when it fired (also written to stderr)."""
        self._last_step, self._published = 0, -1
        self._last = time.monotonic()
        self._slowest = 0.0
        self._paused = self._waiting = 0
        self._done = threading.Event()
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._watch, name="spmd_train-step-watchdog", daemon=True)

    def start(self, step: int) -> StepWatchdog:
        """Start watching a run that has finished `step` steps."""
        self._last_step = step
        self._last = time.monotonic()
        if self.active:
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop watching (the run ended)."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def finished(self, step: int) -> None:
        """A step's results are on the host: progress."""
        now = time.monotonic()
        self._slowest = max(self._slowest, now - self._last)
        self._last, self._last_step = now, step

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """The main thread waits for the devices (and so for every process's part of the step)."""
        self._waiting += 1
        try:
            yield
        finally:
            self._waiting -= 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A phase with no step in it (writing a checkpoint to storage, evaluating): not a stall."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self._last = time.monotonic()

    @property
    def limit_s(self) -> float:
        """Seconds without a finished step after which the process stops: twice the timeout, so that a process
        that died is left to JAX's heartbeats (which name it), or 10x the slowest step if longer."""
        return max(2 * self.timeout_s, SLOWEST_STEP_FACTOR * self._slowest)

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 20)
        while not self._done.wait(poll):
            self._publish()
            idle = time.monotonic() - self._last
            if self._paused:
                continue
            declared = self._declared()
            if declared is None and idle <= self.limit_s:
                continue
            waiting = self._waiting > 0
            self.message = self._explain(idle, waiting, declared)
            sys.stderr.write(self.message + "\n")
            sys.stderr.flush()
            if declared is None:
                self._declare()
            # Every other process sees the stall at its next poll and writes its own message; only then
            # exit (JAX's service ends every process as soon as one has gone).
            self._done.wait(3 * poll + 1.0)
            self._stop(EXIT_STALLED)
            return

    def _publish(self) -> None:
        if self.client is None or self._published == self._last_step:
            return
        with contextlib.suppress(Exception):  # the coordination service reports its own failures
            self.client.key_value_set(f"{_KEY}{self.process}", str(self._last_step), allow_overwrite=True)
            self._published = self._last_step

    def _declared(self) -> int | None:
        """The process that declared the run stalled, if one has."""
        if self.client is None:
            return None
        try:
            return int(self.client.key_value_try_get(_STALLED))
        except Exception:  # not set (or the service is gone: then it ends this process itself)
            return None

    def _declare(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.key_value_set(_STALLED, str(self.process), allow_overwrite=True)

    def _explain(self, idle: float, waiting: bool, declared: int | None) -> str:
        head = (f"process {self.process}: no step has finished for {idle:.0f} s since step {self._last_step}")
        head += (f" (process {declared} found the run stalled)" if declared is not None else
                 f" (limit {self.limit_s:.0f} s: twice run.peer_timeout_s={self.timeout_s:g}, or "
                 f"{SLOWEST_STEP_FACTOR}x the slowest step)")
        if waiting:
            why = f"it is waiting for step {self._last_step + 1}, which every process must take part in; " \
                  + self._peers()
        else:
            why = f"its main thread is stuck outside the step, at {self._main_thread_at()}"
        return (f"{head}: {why}. Stopping (exit {EXIT_STALLED}); restart every process to resume from the latest "
                "checkpoint")

    def _peers(self) -> str:
        if self.client is None:
            return "no other process's progress is known"
        try:
            done = {int(k.rsplit("/", 1)[1]): int(v) for k, v in self.client.key_value_dir_get(_KEY)}
        except Exception as err:  # the service itself may be gone
            return f"the other processes' progress cannot be read ({type(err).__name__})"
        behind = sorted(p for p, s in done.items() if s < self._last_step)
        if behind:
            return "behind it: " + ", ".join(f"process {p} (finished step {done[p]})" for p in behind)
        return f"every process that reported finished step {self._last_step}"

    def _main_thread_at(self) -> str:
        frames = sys._current_frames()
        where = _stack(frames.get(self._main))
        if "prefetch.py" in where:  # waiting for a batch: the place to name is where the batch maker is
            maker = next((t.ident for t in threading.enumerate() if t.name == PREFETCH_THREAD), None)
            where = f"{where}, waiting for the batch its prefetch thread makes, at {_stack(frames.get(maker))}"
        return where


def _stack(frame: Any) -> str:
    """A thread's innermost three frames, innermost first."""
    if frame is None:
        return "an unknown place"
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                       for f in reversed(traceback.extract_stack(frame)[-3:]))

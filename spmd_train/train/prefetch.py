"""Batches made ahead of the step that takes them, in a background thread.

Making a batch (Markov sampling or token-file reads, then the host-to-device copy) is host
work the step never needs to wait for: a thread makes the batches of the next `depth` steps
while the devices run the current one. Batches are pure functions of the step index, so a
prefetched run is bitwise the run made synchronously. The time the loop still waits for a
batch is recorded as `data_wait_s`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

PREFETCH_THREAD = "spmd_train-prefetch"
"""The batch maker's thread name (the step watchdog names where it is when the loop waits on it)."""


class _Failed(NamedTuple):
    error: BaseException


class Prefetcher:
    """Makes `make(step)` for steps first..last-1 in order, at most `depth` ahead of `take` (0: in `take`)."""

    def __init__(self, make: Callable[[int], Any], first: int, last: int, depth: int = 2):
        self._make, self._first, self._last = make, first, last
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._next = first
        self._thread = None
        if depth > 0:
            self._thread = threading.Thread(target=self._work, name=PREFETCH_THREAD, daemon=True)
            self._thread.start()

    def take(self, step: int) -> tuple[Any, float]:
        """(the batch of `step`, seconds this call waited for it); re-raises what failed in the thread."""
        if step != self._next:
            raise ValueError(f"batches are taken in order: expected step {self._next}, asked for {step}")
        start = time.perf_counter()
        item = self._queue.get() if self._thread is not None else self._make(step)
        waited = time.perf_counter() - start
        if isinstance(item, _Failed):
            raise item.error
        self._next += 1
        return item, waited

    def close(self) -> None:
        """Stop making batches and let the thread end (what it made ahead is dropped)."""
        self._stop.set()
        while self._thread is not None and self._thread.is_alive():
            try:  # unblock a put waiting on a full queue
                self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.05)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _work(self) -> None:
        try:
            for step in range(self._first, self._last):
                if self._stop.is_set():
                    return
                self._put(self._make(step))
        except BaseException as err:  # handed to the loop, which raises it where the step would have used it
            self._put(_Failed(err))

    def _put(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

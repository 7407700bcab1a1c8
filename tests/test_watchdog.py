"""The step watchdog: a run whose steps stop finishing ends with exit 3 and says who is stuck, never a healthy one."""

import re
import time

import pytest

from spmd_train.train.watchdog import EXIT_STALLED, StepWatchdog


class _Client:
    """JAX's key-value store as the watchdog uses it."""

    def __init__(self, others: dict[int, int]):
        self.store = {f"spmd_train/finished/{p}": str(s) for p, s in others.items()}

    def key_value_set(self, key, value, allow_overwrite=False):
        assert allow_overwrite
        self.store[key] = value

    def key_value_try_get(self, key):
        return self.store[key]  # KeyError when not set, as JAX raises

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.store.items() if k.startswith(prefix)]


def _watchdog(timeout_s=0.3, **kwargs):
    stops = []
    return StepWatchdog(timeout_s, stop=stops.append, **kwargs), stops


def _until(predicate, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_main_thread_stuck_outside_the_step_names_itself_and_where():
    dog, stops = _watchdog(process=1)
    dog.start(7)
    try:
        _until(lambda: stops)
    finally:
        dog.close()
    assert stops == [EXIT_STALLED]
    assert dog.message.startswith("process 1: no step has finished for 1 s since step 7 (limit 1 s: "
                                  "twice run.peer_timeout_s=0.3, or 10x the slowest step)")
    assert "its main thread is stuck outside the step, at test_watchdog.py:" in dog.message and "_until" in dog.message


def test_a_process_waiting_for_a_step_names_the_processes_behind_it_and_publishes_its_own():
    client = _Client({1: 4, 2: 5, 3: 3})
    dog, stops = _watchdog(process=2, client=client)
    dog.start(4)
    try:
        dog.finished(5)
        with dog.waiting():
            _until(lambda: stops)
    finally:
        dog.close()
    assert stops == [EXIT_STALLED] and client.store["spmd_train/finished/2"] == "5"
    assert client.store["spmd_train/stalled"] == "2"  # declared, so the others write their messages now
    assert ("it is waiting for step 6, which every process must take part in; behind it: process 1 (finished "
            "step 4), process 3 (finished step 3). Stopping (exit 3)") in dog.message


def test_a_stall_declared_by_another_process_is_reported_at_once():
    client = _Client({0: 9})
    client.store["spmd_train/stalled"] = "0"
    dog, stops = _watchdog(timeout_s=2, process=1, client=client)
    dog.start(8)
    try:
        _until(lambda: stops)
    finally:
        dog.close()
    assert stops == [EXIT_STALLED]
    assert re.match(r"process 1: no step has finished for \d s since step 8 \(process 0 found the run stalled\): "
                    r"its main thread is stuck outside the step, at test_watchdog.py:\d+ _until", dog.message)


@pytest.mark.parametrize("paused", [True, False])
def test_paused_phases_and_steps_within_ten_times_the_slowest_are_not_stalls(paused):
    dog, stops = _watchdog(timeout_s=0.1)
    dog.start(0)
    try:
        for step in range(1, 4):  # steps of 0.1 s: the limit grows to about 1 s
            time.sleep(0.1)
            dog.finished(step)
        assert dog.limit_s >= 0.9
        if paused:
            with dog.paused():  # a checkpoint written for 1.5 s, then the clock starts again
                time.sleep(1.5)
            time.sleep(0.3)
        else:
            time.sleep(0.5)
        assert stops == []
    finally:
        dog.close()


def test_an_inactive_watchdog_never_starts_a_thread():
    dog, stops = _watchdog(timeout_s=0.01, active=False)
    dog.start(0)
    time.sleep(0.1)
    dog.close()
    assert stops == [] and not dog._thread.is_alive()

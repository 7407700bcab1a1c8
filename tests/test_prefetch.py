"""Batches made ahead in a background thread: the same batches in the same order, errors where the step is,
a run bitwise the synchronous one, and `data_wait_s` recorded either way."""

from __future__ import annotations

import json
import threading
import time

import jax
import numpy as np
import pytest

from spmd_train import Trainer, load_config
from spmd_train.train.prefetch import Prefetcher
from tests.runs import TINY


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_batches_come_in_step_order_with_the_wait_measured(depth):
    made = []
    with Prefetcher(lambda step: made.append(step) or step * 10, first=5, last=12, depth=depth) as batches:
        got = [batches.take(step) for step in range(5, 12)]
    assert [b for b, _ in got] == [s * 10 for s in range(5, 12)]
    assert made == list(range(5, 12))  # each batch made once, in order
    assert all(w >= 0 for _, w in got)


def test_the_thread_stays_at_most_depth_ahead_and_ends_on_close():
    made = []
    batches = Prefetcher(lambda step: made.append(step) or step, first=0, last=1000, depth=2)
    batches.take(0)
    time.sleep(0.3)
    # taken 1, queued 2, one more made and waiting to be queued
    assert len(made) <= 4
    batches.close()
    assert not any(t.name == "spmd_train-prefetch" and t.is_alive() for t in threading.enumerate())


def test_an_error_making_a_batch_is_raised_by_the_take_of_that_step():
    def make(step):
        if step == 3:
            raise OSError("disk gone")
        return step

    with Prefetcher(make, first=0, last=10, depth=2) as batches:
        for step in range(3):
            assert batches.take(step)[0] == step
        with pytest.raises(OSError, match="disk gone"):
            batches.take(3)


def test_taking_out_of_order_is_refused():
    with Prefetcher(lambda step: step, first=0, last=5, depth=1) as batches, \
            pytest.raises(ValueError, match="expected step 0"):
        batches.take(1)


def _run(tmp_path, devices, prefetch: int):
    cfg = load_config(None, [*TINY, "train.steps=6", "mesh.fsdp=4", "mesh.tensor=2", f"data.prefetch={prefetch}",
                             f"run.dir={tmp_path / str(prefetch)}", "checkpoint.every=0"])
    trainer = Trainer(cfg, list(devices))
    made, make = [], trainer.data.batch
    trainer.data.batch = lambda step, *args, **kw: made.append(step) or make(step, *args, **kw)
    try:
        trainer.run()
        params = [np.asarray(x) for x in jax.tree.leaves(trainer.state.params)]
    finally:
        trainer.close()
    assert made == list(range(6))  # each step's batch made once: compiling lowers against shapes only
    return trainer.history, params


def test_a_prefetched_run_is_bitwise_the_synchronous_one(tmp_path, devices):
    ahead, ahead_params = _run(tmp_path, devices, prefetch=2)
    inline, inline_params = _run(tmp_path, devices, prefetch=0)
    assert [r["loss"] for r in ahead] == [r["loss"] for r in inline]
    for a, b in zip(ahead_params, inline_params, strict=True):
        np.testing.assert_array_equal(a, b)
    for history, folder in ((ahead, "2"), (inline, "0")):
        assert all(r["data_wait_s"] >= 0 for r in history)
        written = [json.loads(line) for line in (tmp_path / folder / "metrics.jsonl").read_text().splitlines()]
        assert [r["data_wait_s"] for r in written] == [r["data_wait_s"] for r in history]

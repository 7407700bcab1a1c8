"""Step guards: a non-finite or spiking step is never applied or saved, and a diverged run stops with exit 3."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmd_train import Engine, Trainer, load_config
from spmd_train.config.train_schema import TrainConfig
from spmd_train.data import make_source
from spmd_train.data.batch import as_batch
from spmd_train.errors import TrainingHalted
from spmd_train.train.checkpoint import Checkpointer
from spmd_train.train.guards import REASONS, GuardState, init_guard, judge, resize_window
from spmd_train.train.restore import Unguarded as _Unguarded
from tests.runs import FP32, TINY, cli

NAN, SPIKE = -1, -2
"""Marks for the first token of a batch (see `injected`): its loss becomes NaN, or 100 times itself."""


@pytest.fixture
def injected(monkeypatch):
    """The test hook: a batch whose first token is negative has its objective turned NaN (-1) or x100 (-2).

    The mark is read on device inside the jitted step, so the guards see exactly what a diverging
    batch would give them; the token itself is restored before the model reads it.
    """
    original = Engine.objective

    def objective(self, params, batch):
        batch = as_batch(batch)
        mark = batch.tokens[0, 0]
        scale = jnp.where(mark == NAN, jnp.nan, jnp.where(mark == SPIKE, 100.0, 1.0))
        value, metrics = original(self, params, batch._replace(tokens=jnp.abs(batch.tokens)))
        return value * scale, {**metrics, "loss": metrics["loss"] * scale}

    monkeypatch.setattr(Engine, "objective", objective)


def _marked(batch, sharding, mark):
    """The batch with its first token replaced by `mark`."""
    tokens = np.asarray(batch.tokens).copy()
    tokens[0, 0] = mark
    return batch._replace(tokens=jax.device_put(tokens, sharding))


def _batch(engine, data, step, marks):
    batch = data.batch(step, engine.batch_sharding)
    return _marked(batch, engine.batch_sharding, marks[step]) if step in marks else batch


def test_skipped_steps_are_bitwise_the_steps_never_taken(injected, devices):
    # Step 2 is NaN; step 6 spikes (x100) once the window of 4 applied steps (0, 1, 3, 4) is full.
    cfg = load_config(None, [*TINY, *FP32, "train.steps=9", "train.spike_window=4"])
    engine, data = Engine.build(cfg, devices), make_source(cfg)
    marks = {2: NAN, 6: SPIKE}
    state, reasons, losses = engine.init_state(), [], []
    for step in range(cfg.train.steps):
        state, metrics = engine.train_step(state, _batch(engine, data, step, marks))
        reasons.append(REASONS[int(metrics["skip_reason"])])
        losses.append(float(metrics["loss"]))
    assert reasons == [None, None, "nonfinite", None, None, None, "spike", None, None]
    assert np.isnan(losses[2]) and losses[6] > 50 * losses[5]
    # The reference consumes batches 2 and 6 without applying them: its step counter (the data
    # position) advances; its parameters, optimizer state (with optax's own count, which drives
    # the learning rate) and spike window do not.
    ref = engine.init_state()
    for step in range(cfg.train.steps):
        if step in marks:
            ref = ref._replace(step=ref.step + 1)
            continue
        ref, ref_metrics = engine.train_step(ref, data.batch(step, engine.batch_sharding))
        assert float(ref_metrics["loss"]) == losses[step]
    for got, want in zip(jax.tree.leaves((state.params, state.opt_state, state.guard.window)),
                         jax.tree.leaves((ref.params, ref.opt_state, ref.guard.window)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int(state.step) == int(ref.step) == 9 and int(state.guard.accepted) == int(ref.guard.accepted) == 7
    assert (int(state.guard.skipped), int(state.guard.consecutive)) == (2, 0)


def test_a_spike_is_measured_against_the_window_with_a_one_percent_floor():
    cfg = TrainConfig(spike_window=4)
    guard = init_guard(cfg)
    converged = guard._replace(window=jnp.array([[3.0, 1.0], [3.0001, 1.0], [2.9999, 1.0], [3.0, 1.0]]),
                               accepted=jnp.array(4, jnp.int32))
    code = lambda g, loss, norm=1.0: REASONS[int(judge(g, jnp.float32(loss), jnp.float32(norm), cfg))]
    # Std 7e-5 would make 3.01 a 140-sigma spike; the floor (1% of the mean) asks for more than 3.18.
    assert code(converged, 3.01) is None and code(converged, 3.2) == "spike"
    assert code(converged, 3.0, norm=1.2) == "spike"  # the gradient norm is judged the same way
    assert code(converged._replace(accepted=jnp.array(3, jnp.int32)), 30.0) is None  # window not full yet
    assert code(converged, float("inf")) == "nonfinite" and code(converged, 3.0, norm=float("nan")) == "nonfinite"
    assert REASONS[int(judge(converged, jnp.float32(3.0), jnp.float32(1.0), cfg, jnp.bool_(False)))] == "nonfinite"
    off = TrainConfig(spike_window=4, spike_sigma=None)
    assert REASONS[int(judge(converged, jnp.float32(300.0), jnp.float32(1.0), off))] is None


def test_a_resumed_run_keeps_its_latest_window_when_the_window_size_changes():
    window = jnp.arange(10, dtype=jnp.float32).reshape(5, 2)  # steps 5..9 in a ring of 5 (step j at j % 5)
    guard = GuardState(window, jnp.array(10, jnp.int32), jnp.array(0, jnp.int32), jnp.array(1, jnp.int32))
    smaller = resize_window(guard, 3)
    np.testing.assert_array_equal(smaller.window, [[4, 5], [6, 7], [8, 9]])  # steps 7, 8, 9
    assert int(smaller.accepted) == 3 and int(smaller.skipped) == 1
    larger = resize_window(guard, 8)
    np.testing.assert_array_equal(larger.window[:5], [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]])
    assert int(larger.accepted) == 5  # judging waits until 8 applied steps fill the new window


@pytest.mark.slow
def test_halt_stops_at_the_first_non_finite_step_and_saves_nothing_after_it(injected, tmp_path, devices):
    cfg = load_config(None, [*TINY, *FP32, "train.steps=6", "train.on_nonfinite=halt", "checkpoint.every=1",
                             f"run.dir={tmp_path}", "checkpoint.async_save=false"])
    trainer = Trainer(cfg, devices)
    batch = trainer.data.batch

    def poisoned(step, sharding, split="train"):
        out = batch(step, sharding, split)
        return _marked(out, sharding, NAN) if (step, split) == (3, "train") else out

    trainer.data.batch = poisoned
    try:
        with pytest.raises(TrainingHalted, match=r"step 4: the loss \(nan\) or gradient norm .* is not finite; "
                                                 r"stopped \(train\.on_nonfinite=halt.*newest checkpoint is step 3"):
            trainer.run()
    finally:
        trainer.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skip_reason"] for r in records] == [None, None, None, "nonfinite"]
    steps = Checkpointer(tmp_path / "checkpoints", read_only=True).steps()
    assert steps == [1, 2, 3]  # step 4 was skipped, and never saved


@pytest.mark.faults
def test_a_diverging_run_exits_3_and_keeps_its_good_checkpoints(tmp_path):
    # The reproduction: a good run, then the same run at a learning rate that explodes.
    good = cli("train", "configs/tiny.yaml", f"run.dir={tmp_path}", "train.steps=40", "checkpoint.every=10")
    assert good.returncode == 0, good.stderr
    bad = cli("train", "configs/tiny.yaml", f"run.dir={tmp_path}", "train.steps=700", "checkpoint.every=5",
              "optim.lr=1e6")
    assert bad.returncode == 3, bad.stderr
    assert "Traceback" not in bad.stderr
    assert "steps in a row were skipped" in bad.stderr and "train.max_consecutive_skips=10" in bad.stderr
    assert bad.stderr.count("steps in a row were skipped") == 1  # the halt paragraph is said once
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["consecutive_skips"] for r in records[-10:]] == list(range(1, 11))
    # No checkpoint was written after the divergence: the good ones are intact and finite.
    ck = Checkpointer(tmp_path / "checkpoints", read_only=True)
    assert ck.steps() == [20, 30, 40]
    for step in ck.steps():
        leaves = [np.asarray(x) for x in jax.tree.leaves(ck.manager.restore(step)["state"])]
        assert all(np.isfinite(x).all() for x in leaves if np.issubdtype(x.dtype, np.floating))


@pytest.mark.slow
def test_resume_carries_the_guards_across_a_window_change_and_from_format_1(tmp_path, devices):
    run = lambda *o: Trainer(load_config(None, [*TINY, "train.steps=4", f"run.dir={tmp_path}",
                                                "checkpoint.async_save=false", *o]), devices)
    first = run("train.spike_window=4")
    first.run()
    window = np.asarray(first.state.guard.window)
    first.close()
    wider = run("train.spike_window=6")
    wider.init()
    assert np.asarray(wider.state.guard.window).shape == (6, 2) and int(wider.state.guard.accepted) == 4
    np.testing.assert_array_equal(np.asarray(wider.state.guard.window)[:4], window)  # 4 applied steps, in order
    # A checkpoint written before the guards existed (format 1: step, params, opt_state) restores with fresh ones.
    state, meta = wider.state, wider.engine.checkpoint_meta(4)
    wider.close()
    Checkpointer(tmp_path / "old" / "checkpoints", async_save=False).save(
        4, _Unguarded(state.step, state.params, state.opt_state), {**meta, "format": 1})
    old = run(f"run.dir={tmp_path / 'old'}")
    old.init()
    assert int(old.state.step) == 4 and int(old.state.guard.accepted) == 0
    np.testing.assert_array_equal(jax.tree.leaves(old.state.params)[0], jax.tree.leaves(state.params)[0])
    old.close()

"""Periodic evaluation on the held-out split: recorded with its step, and invisible to training."""

import json

import pytest

from spmd_train import Trainer, load_config
from spmd_train.errors import ConfigError

BASE = ["model.preset=tiny", "train.global_batch_size=16", "train.seq_len=16", "train.steps=4",
        "checkpoint.every=0", "checkpoint.async_save=false", "run.log_every=100", "optim.lr=1e-2"]


def _run(tmp_path, devices, *overrides):
    trainer = Trainer(load_config(None, [*BASE, f"run.dir={tmp_path}", *overrides]), list(devices))
    trainer.init()
    trainer.run()
    return trainer


def test_eval_every_records_val_loss_of_that_steps_parameters_and_changes_nothing(tmp_path, devices):
    evaluated = _run(tmp_path / "eval", devices, "train.eval_every=2", "train.eval_batches=2")
    plain = _run(tmp_path / "plain", devices)
    steps_with_eval = [r["step"] for r in evaluated.history if "val_loss" in r]
    assert steps_with_eval == [2, 4]
    # Evaluating neither moves the parameters nor the data: the training losses are identical.
    assert [r["loss"] for r in evaluated.history] == [r["loss"] for r in plain.history]
    # Step 4's val_loss is the loss of the final parameters on the same fixed held-out batches.
    assert evaluated.evaluate() == pytest.approx(evaluated.history[-1]["val_loss"], rel=1e-6)
    assert evaluated.history[1]["val_loss"] != evaluated.history[-1]["val_loss"]  # it tracks training
    written = [json.loads(line) for line in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("val_loss") for r in written] == [r.get("val_loss") for r in evaluated.history]
    evaluated.close()
    plain.close()


def test_bad_eval_settings_name_the_key():
    with pytest.raises(ConfigError, match="train.eval_every=-1"):
        load_config(None, [*BASE, "train.eval_every=-1"])
    with pytest.raises(ConfigError, match="train.eval_batches=0"):
        load_config(None, [*BASE, "train.eval_batches=0"])

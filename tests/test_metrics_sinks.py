"""Where step records go: strict JSON in metrics.jsonl, the Weights & Biases mirror, the progress bar."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

from spmd_train import Engine, Trainer, load_config
from spmd_train.errors import ConfigError
from spmd_train.train.metrics import MetricsSink
from tests.runs import ROOT, TINY, cli_env, tensorboard_events


def _strict_loads(line: str):
    def refuse(name):
        raise ValueError(f"bare {name} in metrics.jsonl")

    return json.loads(line, parse_constant=refuse)


def test_non_finite_values_are_written_as_null_and_named(tmp_path):
    sink = MetricsSink(tmp_path, total_steps=2, log_every=1, progress=False)
    base = {"loss": 1.5, "grad_norm": 0.5, "lr": 1e-3, "tokens_per_sec": 10.0, "mfu": None}
    sink.write({"step": 1, **base})
    sink.write({"step": 2, **base, "loss": math.nan, "grad_norm": math.inf})
    sink.close()
    first, second = (_strict_loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert first["loss"] == 1.5 and "nonfinite" not in first
    assert second["loss"] is None and second["grad_norm"] is None and second["nonfinite"] == ["loss", "grad_norm"]


def test_tensorboard_gets_finite_scalars_and_a_resume_hides_the_steps_it_repeats(tmp_path):
    base = {"grad_norm": 0.5, "lr": 1e-3, "tokens_per_sec": 10.0, "mfu": None}
    sink = MetricsSink(tmp_path, total_steps=6, log_every=1, progress=False)
    for step in range(1, 6):  # killed after step 5; its last checkpoint was step 3
        sink.write({"step": step, **base, "loss": math.nan if step == 2 else 1.0})
    sink.close()
    sink = MetricsSink(tmp_path, total_steps=6, log_every=1, start_step=3, progress=False)
    for step in range(4, 7):
        sink.write({"step": step, **base, "loss": 2.0})
    sink.close()
    events = tensorboard_events(tmp_path)
    (start,) = [i for i, e in enumerate(events) if e.HasField("session_log")]

    def losses(part):
        return [(e.step, v.simple_value) for e in part for v in e.summary.value if v.tag == "train/loss"]

    assert losses(events[:start]) == [(1, 1.0), (3, 1.0), (4, 1.0), (5, 1.0)]  # step 2's NaN: metrics.jsonl only
    # TensorBoard drops every earlier event from the START marker's step on: steps 4 and 5 are the resumed run's.
    assert (events[start].step, events[start].session_log.status) == (4, 1)
    assert losses(events[start:]) == [(4, 2.0), (5, 2.0), (6, 2.0)]


def _wandb_run(tmp_path, devices, steps: int):
    cfg = load_config(None, [*TINY, f"train.steps={steps}", "mesh.fsdp=8", "run.wandb=true",
                             "run.wandb_mode=offline", f"run.dir={tmp_path / 'run'}", "checkpoint.every=2"])
    trainer = Trainer(cfg, list(devices))
    try:
        trainer.run()
    finally:
        trainer.close()


@pytest.mark.slow
def test_wandb_offline_mirrors_every_step_and_a_resume_continues_the_same_run(tmp_path, devices):
    pytest.importorskip("wandb", reason="the wandb extra")  # in the dev extra, so CI runs this
    _wandb_run(tmp_path, devices, steps=2)
    run_id = (tmp_path / "run" / "wandb_id").read_text()
    _wandb_run(tmp_path, devices, steps=4)
    assert (tmp_path / "run" / "wandb_id").read_text() == run_id  # resumed into the same W&B run
    offline = sorted((tmp_path / "run" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(offline) == 2  # one file per start, both of the one run, for `wandb sync`
    # The .wandb files are W&B's protobuf log; each history value is stored as its JSON text.
    logged = b"".join(path.read_bytes() for path in offline)
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in history] == [1, 2, 3, 4]
    for record in history:
        assert json.dumps(record["loss"]).encode() in logged, record["step"]
    assert logged.count(b"train/loss") >= 4


def test_wandb_without_the_package_is_refused_before_anything_is_built_or_written(tmp_path, devices, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    built = []
    monkeypatch.setattr(Engine, "build", lambda *a, **k: built.append(a))
    with pytest.raises(ConfigError, match=r"run.wandb=true needs the wandb package"):
        _wandb_run(tmp_path, devices, steps=1)
    assert built == [] and not (tmp_path / "run").exists()  # no engine, no compile, no run.dir


def test_a_script_running_the_api_shows_a_progress_bar_on_a_terminal_and_log_lines_in_a_pipe(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from spmd_train import Trainer, load_config
        cfg = load_config({str(ROOT / 'configs/tiny.yaml')!r}, ["train.steps=3", "run.dir=" + sys.argv[1],
                          "mesh.fsdp=1", "mesh.tensor=1", "run.simulate_devices=null"])
        trainer = Trainer(cfg)
        trainer.run()
        trainer.close()
    """))
    # What a terminal gives rich; a pipe would get the plain log lines instead.
    env = {**cli_env(), "TTY_INTERACTIVE": "1", "TTY_COMPATIBLE": "1", "COLUMNS": "160"}
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "tty")], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    assert "step 3/3" in out.stderr.replace("\x1b", " ") or "3/3" in out.stderr
    assert "tok/s" in out.stderr and "loss" in out.stderr
    # A batch job's stderr (SLURM, nohup, `> out.txt`): the same run logs plain lines.
    piped = subprocess.run([sys.executable, str(script), str(tmp_path / "pipe")], env=cli_env(), capture_output=True,
                           text=True, timeout=300, check=True)
    assert "step 3/3  loss" in piped.stderr and "tok/s" in piped.stderr and "\x1b" not in piped.stderr


def test_wandb_gets_one_histogram_per_moe_layer(monkeypatch):
    from spmd_train.train.wandb_run import WandbRun

    logged = []

    class Run:
        def log(self, values, step, commit):
            logged.append((step, values, commit))

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(Histogram=lambda row: ("histogram", list(row))))
    run = WandbRun.__new__(WandbRun)  # the W&B run itself is the fake's
    run._run = Run()
    run.log({"step": 2, "loss": 1.5}, {"expert_load": np.array([[0.25] * 4, [0.5, 0.5, 0.0, 0.0]])})
    run.log({"step": 3, "loss": 1.25})
    (step, values, commit), (later, plain, _) = logged
    assert (step, commit, later) == (2, True, 3)  # the histograms in the step's own row
    assert values == {"train/loss": 1.5, "train/expert_load.0": ("histogram", [0.25] * 4),
                      "train/expert_load.1": ("histogram", [0.5, 0.5, 0.0, 0.0])}
    assert plain == {"train/loss": 1.25}

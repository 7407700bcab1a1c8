"""Runs that survive: kill -9 and SIGTERM mid-run, then resume to bitwise the same losses."""

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.runs import cli, cli_env

ROOT = Path(__file__).resolve().parents[1]
RUN = ["train", "configs/tiny.yaml", "train.steps=120", "checkpoint.every=10", "run.log_every=1000"]


def _losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    return [r["loss"] for r in records]


def _start_and_interrupt(run_dir: Path, sig: int, after_steps: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "spmd_train", *RUN, f"run.dir={run_dir}"], cwd=ROOT, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= after_steps:
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    proc.send_signal(sig)
    proc.wait(timeout=120)
    return proc


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight")
    proc = cli(*RUN, f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr
    return _losses(run_dir)


def test_kill_9_then_resume_gives_identical_losses(straight, tmp_path):
    proc = _start_and_interrupt(tmp_path, signal.SIGKILL, after_steps=random.Random(0).randint(25, 60))
    assert proc.returncode == -signal.SIGKILL
    resumed = cli(*RUN, f"run.dir={tmp_path}")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr
    assert _losses(tmp_path) == straight  # bitwise: same data order, same state


def test_sigterm_saves_exits_cleanly_and_resumes_identically(straight, tmp_path):
    proc = _start_and_interrupt(tmp_path, signal.SIGTERM, after_steps=random.Random(1).randint(15, 70))
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    assert "stopped by SIGTERM" in out + err and "Traceback" not in err
    stopped_at = len(_losses(tmp_path))
    assert (tmp_path / "checkpoints" / str(stopped_at)).is_dir()  # saved exactly where it stopped
    resumed = cli(*RUN, f"run.dir={tmp_path}")
    assert resumed.returncode == 0, resumed.stderr
    assert f"at step {stopped_at}" in resumed.stderr
    assert _losses(tmp_path) == straight


def test_restoring_another_architecture_exits_2_and_leaves_the_run_intact(tmp_path):
    first = cli("train", "configs/tiny.yaml", "train.steps=5", f"run.dir={tmp_path}")
    assert first.returncode == 0, first.stderr
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    metrics = (tmp_path / "metrics.jsonl").read_text()
    proc = cli("train", "configs/tiny.yaml", "train.steps=10", "model.num_layers=3", f"run.dir={tmp_path}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "model.num_layers: checkpoint 2, this run 3" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before
    assert (tmp_path / "metrics.jsonl").read_text() == metrics


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["data.source=tokens", "data.paths=[/nonexistent/data.bin]"], "/nonexistent/data.bin does not exist"),
        (["run.profile_steps=[5,500]"], "run.profile_steps=[5, 500]"),
        (["train.resume=never"], "train.resume=never"),
    ],
    ids=["missing-data", "profile-outside", "resume-never"],
)
def test_bad_run_input_exits_2(tmp_path, args, needle):
    if "train.resume=never" in args:
        assert cli("train", "configs/tiny.yaml", "train.steps=3", f"run.dir={tmp_path}").returncode == 0
    proc = cli("train", "configs/tiny.yaml", "train.steps=20", f"run.dir={tmp_path}", *args)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr

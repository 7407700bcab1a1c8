"""One writer per run directory: a second job on a run.dir exits 2 naming the holder; a dead holder's lock is free."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time

import pytest

from spmd_train import Trainer, load_config
from tests.runs import ROOT, TINY, cli, cli_env


@pytest.mark.faults
def test_a_second_job_on_a_run_dir_exits_2_naming_the_holder(tmp_path):
    first = subprocess.Popen([sys.executable, "-m", "spmd_train", "train", "configs/tiny.yaml", f"run.dir={tmp_path}",
                              "train.steps=120"], cwd=ROOT, env=cli_env(optimized=True), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    lock = tmp_path / ".lock"
    deadline = time.monotonic() + 120
    while not (lock.exists() and lock.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1)
    second = cli("train", "configs/tiny.yaml", f"run.dir={tmp_path}", "train.steps=120", optimized=True)
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    assert second.returncode == 2 and "Traceback" not in second.stderr
    assert f"run.dir={tmp_path} is in use by another training process (host " in second.stderr
    assert f"pid {first.pid}," in second.stderr and "another run.dir" in second.stderr
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 121))  # every step once: the second job wrote nothing


def test_a_dead_holders_lock_is_free_and_one_process_shares_its_own(tmp_path, devices):
    (tmp_path / ".lock").write_text(json.dumps({"host": "gone", "pid": 999999, "started": "earlier"}))
    cfg = load_config(None, [*TINY, f"run.dir={tmp_path}"])
    first, again = Trainer(cfg, devices), Trainer(cfg, devices)
    first.init()
    again.init()  # a notebook re-creating its trainer: the same writer
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    first.close()
    with open(tmp_path / ".lock") as other, pytest.raises(BlockingIOError):  # held while one trainer is open
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    again.close()
    with open(tmp_path / ".lock") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free once the last trainer closed

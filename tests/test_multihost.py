"""The multi-controller runtime: 2 processes x 4 CPU devices (gloo) behave as 1 process x 8; a lost process
ends the others within `run.peer_timeout_s`, and restarting both resumes."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.runs import cli_env, uncached_env

ROOT = Path(__file__).resolve().parents[1]
# A constant learning rate after warmup (min_lr_ratio=1): the schedule does not depend on train.steps, so the
# killed run (steps far past the test) and the runs that finish at 14 and 16 take the same steps.
RUN = ["train", "configs/tiny.yaml", "checkpoint.every=5", "run.log_every=1000", "optim.min_lr_ratio=1"]
PEER_TIMEOUT_S = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _single(*args):
    proc = subprocess.run([sys.executable, "-m", "spmd_train", *RUN, *args], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc


def _two_processes(run_dir: Path, *args, launch: tuple[str, ...] = ("-m", "spmd_train")) -> list[subprocess.Popen]:
    port = _free_port()
    return [
        subprocess.Popen([sys.executable, *launch, *RUN, *args, "run.simulate_devices=4",
                          f"run.coordinator=127.0.0.1:{port}", "run.num_processes=2", f"run.process_id={i}",
                          f"run.peer_timeout_s={PEER_TIMEOUT_S}", f"run.dir={run_dir}"],
                         cwd=ROOT, env=uncached_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]


def _close(rel: list[float], ref: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(rel, ref, strict=True))


@pytest.mark.multiprocess
def test_a_lost_process_ends_the_other_and_both_resume_to_match_one_process(tmp_path):
    multi = tmp_path / "multi"
    # A run far longer than the test: process 1 is killed once checkpoint 10 is complete.
    procs = _two_processes(multi, "train.steps=100000")
    deadline = time.monotonic() + 240
    while not (multi / "checkpoints" / "10").is_dir():
        assert time.monotonic() < deadline and procs[0].poll() is None, procs[0].communicate()[1][-3000:]
        time.sleep(0.05)
    procs[1].kill()
    killed_at = time.monotonic()
    _, err = procs[0].communicate(timeout=PEER_TIMEOUT_S + 60)
    took = time.monotonic() - killed_at
    procs[1].communicate()
    assert procs[0].returncode != 0
    assert took <= PEER_TIMEOUT_S + 30, took
    # JAX's coordination service names the process that stopped sending heartbeats.
    assert "stopped sending heartbeats" in err and err.split("stopped sending heartbeats):", 1)[1].split()[0] == "1"

    # Restart both from step 10 (the later checkpoints the killed run wrote move aside) and finish at 14.
    procs = _two_processes(multi, "train.steps=14", "train.resume_step=10")
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err
    assert "resumed from" in outputs[0][1] and "at step 10" in outputs[0][1]
    assert "done: step 14" in outputs[0][0] and "done" not in outputs[1][0]  # only process 0 reports
    assert sorted(int(x.name) for x in (multi / "checkpoints").iterdir()) == [5, 10, 14]
    aside = multi / "superseded_checkpoints"
    assert all(int(x.name) > 10 for x in aside.iterdir()) if aside.exists() else True

    single = tmp_path / "single"
    _single("train.steps=16", f"run.dir={single}")
    reference = _losses(single)
    two = _losses(multi)
    assert len(two) == 14  # each step once: the killed run's records past step 10 were dropped
    assert _close(two, reference[:14]) <= 1e-5

    # One 8-device process picks up the checkpoint the two processes wrote together.
    resumed = _single("train.steps=16", f"run.dir={multi}")
    assert "resumed from" in resumed.stderr and "at step 14" in resumed.stderr
    after = _losses(multi)
    assert len(after) == 16
    assert _close(after[14:], reference[14:]) <= 1e-5


# The CLI with process 1's main thread hung while reading the batch for step 8 (its heartbeats go on).
HANG_AT_STEP_8 = """
import sys, time
import jax
from spmd_train.cli.main import main
from spmd_train.train.trainer import Trainer
read = Trainer._batch
def hang(self, step):
    if step == 8 and jax.process_index() == 1:
        time.sleep(3600)
    return read(self, step)
Trainer._batch = hang
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.multiprocess
def test_a_process_hung_outside_the_step_ends_both_naming_it(tmp_path):
    procs = _two_processes(tmp_path, "train.steps=40", launch=("-c", HANG_AT_STEP_8))
    started = time.monotonic()
    (_, err0), (_, err1) = (p.communicate(timeout=300) for p in procs)
    # The first to exit exits 3; JAX's service then ends the other (both have written their messages).
    assert 3 in [p.returncode for p in procs] and 0 not in [p.returncode for p in procs], err0[-2000:] + err1[-2000:]
    assert time.monotonic() - started < 120
    # The hung process names itself and where it is; the one waiting names the process behind it.
    assert "process 1: no step has finished for" in err1 and "stuck outside the step, at" in err1
    assert "hang" in err1.split("stuck outside the step, at", 1)[1].splitlines()[0]
    assert "process 0: no step has finished for" in err0 and "behind it: process 1 (finished step 7)" in err0

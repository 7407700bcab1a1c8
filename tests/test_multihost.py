"""The multi-controller runtime: 2 processes x 4 CPU devices (gloo) behave as 1 process x 8."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runs import cli_env

ROOT = Path(__file__).resolve().parents[1]
RUN = ["train", "configs/tiny.yaml", "checkpoint.every=5", "run.log_every=1000"]


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


@pytest.mark.heavy
def test_two_processes_match_one_and_a_single_process_resumes_their_checkpoint(tmp_path):
    port = _free_port()
    multi = tmp_path / "multi"
    procs = [
        subprocess.Popen([sys.executable, "-m", "spmd_train", *RUN, "train.steps=10", "run.simulate_devices=4",
                          f"run.coordinator=127.0.0.1:{port}", "run.num_processes=2", f"run.process_id={i}",
                          f"run.dir={multi}"], cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=False):
        assert p.returncode == 0, err
    assert "done: step 10" in outputs[0][0] and "done" not in outputs[1][0]  # only process 0 reports
    assert sorted(x.name for x in (multi / "checkpoints").iterdir()) == ["10", "5"]

    single = tmp_path / "single"
    _single("train.steps=12", f"run.dir={single}")
    reference = _losses(single)
    two = _losses(multi)
    assert len(two) == 10
    assert max(abs(a - b) / abs(b) for a, b in zip(two, reference[:10], strict=False)) <= 1e-5

    # One 8-device process picks up the checkpoint the two processes wrote together.
    resumed = _single("train.steps=12", f"run.dir={multi}")
    assert "resumed from" in resumed.stderr and "at step 10" in resumed.stderr
    after = _losses(multi)
    assert len(after) == 12
    assert max(abs(a - b) / abs(b) for a, b in zip(after[10:], reference[10:], strict=False)) <= 1e-5

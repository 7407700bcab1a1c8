"""Runs that survive: kill -9 and SIGTERM mid-run, then resume to bitwise the same losses."""

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from spmd_train import Trainer, load_config
from spmd_train.errors import ConfigError
from spmd_train.train.metrics import read_history
from spmd_train.train.run_record import record_config
from tests.runs import cli_env, main_in_process
from tests.tiers import fast_cases

ROOT = Path(__file__).resolve().parents[1]
RUN = ["train", "configs/tiny.yaml", "train.steps=120", "checkpoint.every=10", "run.log_every=1000"]


def _losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    return [r["loss"] for r in records]


def _env(cache: Path) -> dict[str, str]:
    # JAX's persistent compilation cache: a restart loads the step it compiled before (2 s instead of 10); XLA's
    # optimizing backend, since that compile is paid once and each run steps 2.4x faster (120 steps: 13 s, not 32).
    return {**cli_env(optimized=True), "JAX_COMPILATION_CACHE_DIR": str(cache),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def _start(run_dir: Path, cache: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "spmd_train", *RUN, f"run.dir={run_dir}"], cwd=ROOT,
                            env=_env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(proc: subprocess.Popen, ready, what: str) -> None:
    deadline = time.time() + 240
    while not ready():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()[1][-3000:]}"
        assert time.time() < deadline, f"no {what} within 240 s"
        time.sleep(0.002)


def _records(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _saving(run_dir: Path) -> set[str]:
    """The checkpoints being written now (Orbax's temporary directories)."""
    ckpt = run_dir / "checkpoints"
    return {p.name for p in ckpt.iterdir() if "tmp" in p.name} if ckpt.is_dir() else set()


def _start_and_interrupt(run_dir: Path, cache: Path, sig: int, after_steps: int) -> subprocess.Popen:
    proc = _start(run_dir, cache)
    _wait_for(proc, lambda: _records(run_dir) >= after_steps, f"step {after_steps}")
    proc.send_signal(sig)
    proc.wait(timeout=120)
    return proc


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("compilation_cache")


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache):
    """The uninterrupted run (it also fills the compilation cache, so the killed runs only read it)."""
    run_dir = tmp_path_factory.mktemp("straight")
    proc = subprocess.run([sys.executable, "-m", "spmd_train", *RUN, f"run.dir={run_dir}"], cwd=ROOT,
                          env=_env(cache), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return run_dir


def _final_state(run_dir: Path):
    trainer = Trainer(load_config(ROOT / "configs/tiny.yaml", [f"run.dir={run_dir}"]), jax.devices())
    try:
        return jax.device_get(trainer.init())
    finally:
        trainer.close()


@pytest.mark.faults
def test_ten_kills_anywhere_then_resume_equal_the_uninterrupted_run_bitwise(straight, cache, tmp_path):
    """SIGKILL at 10 seeded moments: while starting (restore, compile), at a random step, and while an
    asynchronous checkpoint is being written; each restart resumes from what was left on disk."""
    rng = random.Random(0)
    where = ["start", "step", "save"] * 3 + ["save"]
    rng.shuffle(where)
    for kind in where:
        before = _saving(tmp_path)  # left by a killed save; removed when the run reopens its checkpoints
        proc = _start(tmp_path, cache)
        if kind == "start":
            time.sleep(rng.uniform(0.2, 3.0))
        elif kind == "step":
            target = _records(tmp_path) + rng.randint(1, 15)
            _wait_for(proc, lambda t=target: _records(tmp_path) >= t, f"step {target}")
        else:  # during this attempt's first or second save
            nth, seen = rng.randint(1, 2), set()

            def saving(nth=nth, seen=seen, before=before):
                seen.update(_saving(tmp_path) - before)
                return len(seen) >= nth

            _wait_for(proc, saving, f"asynchronous save {nth}")
        assert proc.poll() is None, "the run finished before it could be killed"
        proc.kill()
        proc.wait(timeout=120)
    resumed = subprocess.run([sys.executable, "-m", "spmd_train", *RUN, f"run.dir={tmp_path}"], cwd=ROOT,
                             env=_env(cache), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert _losses(tmp_path) == _losses(straight)  # each step once, bitwise: same data order, same state
    ours, theirs = _final_state(tmp_path), _final_state(straight)
    assert int(ours.step) == 120
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(a, b)


RESUMED = {
    "tiny": ("configs/tiny.yaml", []),
    # Auxiliary-loss-free balancing: the router biases are train state, saved and restored with the rest.
    "moe_router_bias": ("configs/moe.yaml", ["model.moe.router_score=sigmoid", "model.moe.bias_update_rate=0.01",
                                             "model.moe.n_group=2", "train.global_batch_size=8", "train.seq_len=32"]),
    # Muon's state is two parts (optax.partition), each masking the other's parameters out.
    "muon": ("configs/tiny.yaml", ["optim.name=muon"]),
}


@pytest.mark.parametrize("run", fast_cases(RESUMED, fast=["tiny"]))
def test_a_run_stopped_and_resumed_equals_the_uninterrupted_run_bitwise(tmp_path, devices, run):
    # In process: a run stopped after its step-3 checkpoint, then resumed by a new Trainer in the same run.dir,
    # gives each step's loss and the final state bit for bit (the kill and SIGTERM variants are `faults`).
    config, extra = RESUMED[run]
    overrides = ["train.steps=6", "checkpoint.every=3", "checkpoint.async_save=false", "run.log_every=1000", *extra]

    def trainer(run_dir):
        return Trainer(load_config(ROOT / config, [*overrides, f"run.dir={run_dir}"]), devices)

    straight = trainer(tmp_path / "straight")
    straight.run()
    straight.close()
    first = trainer(tmp_path / "resumed")
    first.run(3)
    first.close()
    again = trainer(tmp_path / "resumed")
    again.init()
    assert again.step_count == 3
    again.run()
    again.close()
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")
    for a, b in zip(jax.tree.leaves(jax.device_get(again.state)), jax.tree.leaves(jax.device_get(straight.state)),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    if run == "moe_router_bias":  # the biases moved, and the resumed run's biases are the straight run's
        bias = np.asarray(jax.device_get(again.state.params["blocks"]["moe"]["mlp"]["router_bias"]))
        assert np.abs(bias).max() > 0


@pytest.mark.faults
def test_sigterm_saves_exits_cleanly_and_resumes_identically(straight, cache, tmp_path):
    proc = _start_and_interrupt(tmp_path, cache, signal.SIGTERM, after_steps=random.Random(1).randint(15, 70))
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    assert "stopped by SIGTERM" in out + err and "Traceback" not in err
    stopped_at = len(_losses(tmp_path))
    assert (tmp_path / "checkpoints" / str(stopped_at)).is_dir()  # saved exactly where it stopped
    resumed = subprocess.run([sys.executable, "-m", "spmd_train", *RUN, f"run.dir={tmp_path}"], cwd=ROOT,
                             env=_env(cache), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert f"at step {stopped_at}" in resumed.stderr
    assert _losses(tmp_path) == _losses(straight)


def test_restoring_another_architecture_exits_2_and_leaves_the_run_intact(tmp_path, capsys):
    code, _, err = main_in_process("train", "configs/tiny.yaml", "train.steps=5", f"run.dir={tmp_path}", capsys=capsys)
    assert code == 0, err
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    metrics = (tmp_path / "metrics.jsonl").read_text()
    code, _, err = main_in_process("train", "configs/tiny.yaml", "train.steps=10", "model.num_layers=3",
                                   f"run.dir={tmp_path}", capsys=capsys)
    assert code == 2 and "Traceback" not in err
    assert "model.num_layers: checkpoint 2, this run 3" in err
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before
    assert (tmp_path / "metrics.jsonl").read_text() == metrics


def test_a_run_dir_that_is_a_file_or_cannot_be_created_exits_2(tmp_path, capsys):
    (tmp_path / "afile").write_text("keep me")
    for run_dir, needle in ((tmp_path / "afile", "is a file, not a directory"),
                            (Path("/proc/spmd_train_run"), "cannot be created")):
        code, _, err = main_in_process("train", "configs/tiny.yaml", "train.steps=2", f"run.dir={run_dir}",
                                       capsys=capsys)
        assert code == 2 and "Traceback" not in err, err
        assert f"run.dir={run_dir} {needle}" in err
    assert (tmp_path / "afile").read_text() == "keep me"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["data.source=tokens", "data.paths=[/nonexistent/data.bin]"], "/nonexistent/data.bin does not exist"),
        (["run.profile_steps=[5,500]"], "run.profile_steps=[5, 500]"),
        (["train.resume=never"], "train.resume=never"),
    ],
    ids=["missing-data", "profile-outside", "resume-never"],
)
def test_bad_run_input_exits_2(tmp_path, args, needle, capsys):
    if "train.resume=never" in args:
        assert main_in_process("train", "configs/tiny.yaml", "train.steps=3", f"run.dir={tmp_path}",
                               capsys=capsys)[0] == 0
    code, _, err = main_in_process("train", "configs/tiny.yaml", "train.steps=20", f"run.dir={tmp_path}", *args,
                                   capsys=capsys)
    assert code == 2, err
    assert needle in err and "Traceback" not in err


def test_run_with_a_step_count_below_one_is_refused_naming_it(tmp_path, devices):
    trainer = Trainer(load_config(ROOT / "configs/tiny.yaml", [f"run.dir={tmp_path}"]), devices)
    for steps in (-5, 0, 2.5):
        with pytest.raises(ConfigError, match=rf"Trainer.run\(steps={steps}\).*valid: an integer >= 1, or None"):
            trainer.run(steps)
    assert trainer.step_count == 0 and not (tmp_path / "metrics.jsonl").exists()
    trainer.close()


def test_a_record_cut_short_by_a_kill_is_dropped_and_a_damaged_one_is_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": i, "loss": 1.0 / i}) for i in (1, 2, 3)]
    path.write_text("\n".join(lines) + '\n{"step": 4, "lo')  # killed while writing step 4
    assert [r["step"] for r in read_history(path, 2)] == [1, 2]
    assert path.read_text().splitlines() == lines[:2] and not path.with_name("metrics.jsonl.partial").exists()
    path.write_text("\n".join([lines[0], "garbage", lines[2]]) + "\n")
    with pytest.raises(ConfigError, match=r"metrics.jsonl line 2 is not a JSON record"):
        read_history(path, 3)


def test_a_resume_with_other_settings_records_what_changed(tmp_path):
    first = {"train": {"steps": 3, "seed": 0}, "mesh": {"fsdp": 4}, "resolved": {"rules": [["batch", ["fsdp"]]]}}
    assert record_config(tmp_path, first, 0) == {}
    assert record_config(tmp_path, first, 3) == {}  # the same again: nothing to record
    assert not (tmp_path / "config_changes.jsonl").exists()
    longer = {**first, "train": {"steps": 6, "seed": 0}, "mesh": {"fsdp": 2}}
    assert record_config(tmp_path, longer, 3) == {"mesh.fsdp": [4, 2], "train.steps": [3, 6]}
    assert json.loads((tmp_path / "config.json").read_text()) == longer
    (line,) = (tmp_path / "config_changes.jsonl").read_text().splitlines()
    assert json.loads(line)["step"] == 3 and json.loads(line)["changes"] == {"mesh.fsdp": [4, 2], "train.steps": [3, 6]}

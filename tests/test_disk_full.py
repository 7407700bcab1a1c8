"""A checkpoint that cannot be written: a clear stop (exit 3) naming the directory, the complete checkpoints intact."""

from __future__ import annotations

import subprocess

import orbax.checkpoint as ocp
import pytest

from spmd_train import Trainer, load_config
from spmd_train.errors import CheckpointWriteError
from spmd_train.train.checkpoint import Checkpointer
from tests.runs import TINY, cli


@pytest.mark.faults
def test_a_failed_write_stops_the_run_naming_the_directory_and_keeps_what_is_saved(tmp_path, devices, monkeypatch):
    # Injected: the third save's write fails as a full disk makes Orbax fail (RESOURCE_EXHAUSTED).
    cfg = load_config(None, [*TINY, "train.steps=12", "checkpoint.every=3", f"run.dir={tmp_path}"])
    trainer = Trainer(cfg, devices)
    save, calls = ocp.CheckpointManager.save, []

    def failing(self, step, *args, **kwargs):
        calls.append(step)
        if len(calls) == 3:
            raise ValueError('RESOURCE_EXHAUSTED: Failed writing: "ocdbt.process_0/d/1f2e" [OS error 28: No space left '
                             'on device]')
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", failing)
    with pytest.raises(CheckpointWriteError, match=rf"writing checkpoint step 9 to {tmp_path / 'checkpoints'} failed "
                                                   r"\(ValueError: RESOURCE_EXHAUSTED.*No space left on device.*steps "
                                                   r"\[3, 6\]\) are intact"):
        trainer.run()
    trainer.close()  # the failure is not raised a second time
    monkeypatch.undo()
    again = Trainer(cfg, devices)
    again.init()
    assert again.step_count == 6
    again.close()


def _mount_tmpfs(path, size):
    path.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                          check=False)
    if done.returncode:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.decode().strip()}); the injected case above runs")


@pytest.mark.faults
def test_a_full_filesystem_exits_3_and_a_rerun_resumes(tmp_path):
    # Real: checkpoints/ on a 3.5 MB tmpfs holds two of the tiny run's 1.3 MB checkpoints, not three.
    checkpoints = tmp_path / "checkpoints"
    _mount_tmpfs(checkpoints, "3500k")
    try:
        full = cli("train", "configs/tiny.yaml", f"run.dir={tmp_path}", "train.steps=40", "checkpoint.every=10")
        assert full.returncode == 3 and "Traceback" not in full.stderr, full.stderr[-2000:]
        assert f"writing checkpoint step 30 to {checkpoints} failed" in full.stderr
        assert "steps [10, 20]) are intact" in full.stderr
        assert Checkpointer(checkpoints, read_only=True).steps() == [10, 20]
        # Space freed by hand (step 10 removed); the rerun cleans the half-written step 30 up, resumes from
        # step 20 and saves again.
        subprocess.run(["rm", "-rf", str(checkpoints / "10")], check=True)
        again = cli("train", "configs/tiny.yaml", f"run.dir={tmp_path}", "train.steps=25", "checkpoint.every=10")
        assert again.returncode == 0, again.stderr[-2000:]
        assert "resumed from" in again.stderr and "at step 20" in again.stderr
        assert Checkpointer(checkpoints, read_only=True).steps() == [20, 25]
    finally:
        subprocess.run(["umount", str(checkpoints)], check=False)

"""Checkpoints: resharding on restore, corrupt and half-written checkpoints, weights from another run."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from spmd_train import Trainer, load_config
from spmd_train.errors import ConfigError
from spmd_train.train.checkpoint import Checkpointer
from tests.runs import relative_error

BASE = ["model.preset=tiny", "train.global_batch_size=16", "train.seq_len=16", "train.steps=6",
        "checkpoint.every=3", "run.log_every=100"]


def _trainer(run_dir, devices, *overrides):
    return Trainer(load_config(None, [*BASE, f"run.dir={run_dir}", *overrides]), list(devices))


def _np(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.mark.slow
def test_restore_onto_another_mesh_and_zero_stage_gives_the_saved_values(tmp_path, devices):
    saver = _trainer(tmp_path, devices, "mesh.fsdp=8", "parallel.zero_stage=3")
    saver.init()
    saver.run(3)
    saver.close()
    saved = _np((saver.state.params, saver.state.opt_state))
    for overrides, devs in (
        (["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=4", "parallel.zero_stage=0"], devices),
        (["mesh.fsdp=4", "parallel.zero_stage=1"], devices[:4]),
    ):
        restorer = _trainer(tmp_path, devs, *overrides)
        restorer.init()
        assert restorer.step_count == 3
        got = _np((restorer.state.params, restorer.state.opt_state))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(saved), strict=True):
            np.testing.assert_array_equal(a, b)
        spec = restorer.state.params["blocks"]["mlp"]["w_up"].sharding.spec
        assert "fsdp" not in str(spec) or overrides[-1].endswith("1")  # laid out for the new mesh
        record = restorer.step()  # and training continues from there
        assert record["step"] == 4 and np.isfinite(record["loss"])
        restorer.close()
        shutil.rmtree(tmp_path / "checkpoints" / "4", ignore_errors=True)


def _scribble(step_dir):
    for path in (step_dir / "state").rglob("*"):
        if path.is_file() and path.stat().st_size > 0 and "meta" not in path.name.lower():
            path.write_bytes(b"\0" * 7)  # over the array data


def _truncate(step_dir):
    data = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def _bad_metadata(step_dir):
    (step_dir / "meta" / "metadata").write_text("{not json")


def _changed_values(step_dir):
    # Values that read back fine but are not what was saved: the fingerprint recorded at save catches them.
    meta = json.loads((step_dir / "meta" / "metadata").read_text())
    meta["fingerprint"][5][0] ^= 1
    (step_dir / "meta" / "metadata").write_text(json.dumps(meta))


# A truncated file names TensorStore's own reason (the file and the byte range), not Orbax's wrapper and its repr.
DAMAGE = {"scribbled": (_scribble, "cannot be read"), "truncated": (_truncate, "is not valid for value of size"),
          "metadata": (_bad_metadata, "metadata is unreadable"),
          "values": (_changed_values, "1 arrays differ from the fingerprint recorded when it was saved (first: ")}


@pytest.mark.faults
def test_a_damaged_latest_checkpoint_is_moved_aside_and_the_run_passes_its_step_again(tmp_path, devices, caplog):
    trainer = _trainer(tmp_path / "run", devices, "mesh.fsdp=8", "checkpoint.async_save=false")
    trainer.init()
    trainer.run()
    trainer.close()
    assert Checkpointer(tmp_path / "run" / "checkpoints").steps() == [3, 6]
    for kind, (damage, needle) in DAMAGE.items():
        run = tmp_path / kind
        shutil.copytree(tmp_path / "run", run)
        damage(run / "checkpoints" / "6")
        again = _trainer(run, devices, "mesh.fsdp=8", "checkpoint.async_save=false")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="spmd_train"):
            again.init()
        assert again.step_count == 3, kind
        assert f"checkpoint {run / 'checkpoints' / '6'} is damaged: " in caplog.text and needle in caplog.text, kind
        assert f"moved to {run / 'damaged_checkpoints' / '6'}" in caplog.text
        assert "bound method" not in caplog.text and "TensorStore({" not in caplog.text, caplog.text
        if kind == "values":
            again.run()  # training passes step 6 again and saves it where the damaged one was
            assert Checkpointer(run / "checkpoints").steps() == [3, 6]
            np.testing.assert_array_equal(_np(again.state.params["embedding"]), _np(trainer.state.params["embedding"]))
        again.close()
    run = tmp_path / "scribbled"
    _scribble(run / "checkpoints" / "3")
    with pytest.raises(ConfigError, match=r"all of steps \[3\] are damaged"):
        _trainer(run, devices, "mesh.fsdp=8").init()


@pytest.mark.slow
def test_resume_step_goes_back_to_a_saved_step_and_sets_the_newer_ones_aside(tmp_path, devices):
    run = tmp_path / "run"
    first = _trainer(run, devices, "mesh.fsdp=8", "checkpoint.async_save=false", "train.steps=9")
    first.init()
    first.run()
    first.close()
    losses = [r["loss"] for r in first.history]
    with pytest.raises(ConfigError, match=r"train.resume_step=4: .*checkpoints has no complete checkpoint at that "
                                          r"step \(valid: one of \[3, 6, 9\]\)"):
        _trainer(run, devices, "mesh.fsdp=8", "train.steps=9", "train.resume_step=4").init()
    with pytest.raises(ConfigError, match=r"train.resume_step=3 asks to resume, and train.resume=never refuses"):
        load_config(None, [*BASE, "train.resume_step=3", "train.resume=never"])
    again = _trainer(run, devices, "mesh.fsdp=8", "checkpoint.async_save=false", "train.steps=9",
                     "train.resume_step=3")
    again.init()
    assert again.step_count == 3 and [r["step"] for r in again.history] == [1, 2, 3]
    assert sorted(p.name for p in (run / "superseded_checkpoints").iterdir()) == ["6", "9"]  # kept, not deleted
    again.run()  # passes steps 6 and 9 again, saving them where the superseded ones were
    again.close()
    assert Checkpointer(run / "checkpoints").steps() == [3, 6, 9]
    assert [r["loss"] for r in again.history] == losses  # bitwise: the same steps again
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == list(
        range(1, 10))


def test_a_saved_step_is_not_saved_again_a_finished_run_compiles_nothing_step_records_reach_the_file(tmp_path, devices):
    trainer = _trainer(tmp_path, devices, "train.steps=3")
    trainer.init()
    trainer.run()  # saves step 3 at the end (asynchronously)
    trainer.save()  # docs/python-api.md's API block does this next: Orbax would raise "step already exists"
    trainer.save(wait=True)
    trainer.close()
    assert Checkpointer(tmp_path / "checkpoints").steps() == [3]
    again = _trainer(tmp_path, devices, "train.steps=3")
    assert again.run() == [] and again.step_count == 3 and again.compile_time_s is None
    again.step()  # one more by hand: its record reaches metrics.jsonl like run()'s
    with pytest.raises(ConfigError, match=r"show_sharding\('blocks.mlp.w_upp'\): no such parameter; did you mean "
                                          r"'blocks.mlp.w_up'"):
        again.show_sharding("blocks.mlp.w_upp")
    again.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


@pytest.mark.faults
def test_a_run_whose_every_checkpoint_was_set_aside_refuses_until_told_to_start_over(tmp_path, devices):
    # A requeued job reruns the identical command: it must not train from step 1 over the run's history.
    run = tmp_path / "run"
    first = _trainer(run, devices, "checkpoint.async_save=false")
    first.init()
    first.run()
    first.close()
    history = (run / "metrics.jsonl").read_text()
    for step in (3, 6):
        _scribble(run / "checkpoints" / str(step))
    with pytest.raises(ConfigError, match=r"all of steps \[3, 6\] are damaged"):
        _trainer(run, devices).init()
    for _ in range(2):  # the rerun, and the one after it
        with pytest.raises(ConfigError, match=r"no checkpoint left to resume from: steps \['3', '6'\] were set aside "
                                              r".*damaged_checkpoints.*valid: train.resume=never to start over"):
            _trainer(run, devices).init()
        assert (run / "metrics.jsonl").read_text() == history
    over = _trainer(run, devices, "train.resume=never", "train.steps=2")
    over.init()
    assert over.step_count == 0
    over.run()
    over.close()
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


@pytest.mark.slow
def test_load_from_starts_from_another_runs_weights(tmp_path, devices):
    donor = _trainer(tmp_path / "donor", devices, "mesh.fsdp=8")
    donor.init()
    donor.run()
    donor.close()
    # One step of the donor by its directory (the form the schema documents), or a step it does not have.
    steps = tmp_path / "donor" / "checkpoints"
    earlier = _trainer(tmp_path / "earlier", devices, f"checkpoint.load_from={steps / '3'}")
    earlier.init()
    saved = Checkpointer(steps, read_only=True).manager.restore(3)["state"]["params"]
    assert relative_error(_np(earlier.state.params), _np(saved)) == 0.0
    assert relative_error(_np(earlier.state.params), _np(donor.state.params)) > 0
    earlier.close()
    with pytest.raises(ConfigError, match=r"checkpoints/4 holds no checkpoint at step 4 \(valid steps there: \[3, 6\]"):
        _trainer(tmp_path / "none", devices, f"checkpoint.load_from={steps / '4'}").init()
    assert not (tmp_path / "none").exists()  # refused: nothing written (no lock file, no checkpoints/)
    # Another mesh and another rope_theta (a context-length fine-tune): only the parameter shapes must match.
    child = _trainer(tmp_path / "child", devices, "mesh.data=8", "mesh.fsdp=1", "model.rope_theta=50000.0",
                     f"checkpoint.load_from={tmp_path / 'donor'}")
    child.init()
    assert child.step_count == 0  # fresh optimizer and schedule, donor's weights
    assert relative_error(_np(child.state.params), _np(donor.state.params)) == 0.0
    child.close()


@pytest.mark.faults
def test_a_crash_during_an_async_save_leaves_the_previous_checkpoint(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, numpy as np, jax, jax.numpy as jnp
        from spmd_train.train.checkpoint import Checkpointer
        ck = Checkpointer({str(tmp_path)!r}, keep=5, async_save=True)
        ck.save(1, {{"w": jnp.ones((4,))}}, {{"step": 1}})
        ck.wait()
        big = {{"w": jnp.asarray(np.random.default_rng(0).random((96, 1024, 1024), dtype=np.float32))}}
        ck.save(2, big, {{"step": 2}})
        os.kill(os.getpid(), signal.SIGKILL)  # die while step 2 is being written
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    proc = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ck = Checkpointer(tmp_path)
    assert ck.steps() == [1]  # the half-written step 2 is not listed
    target = {"w": jax.ShapeDtypeStruct((4,), np.float32)}
    step, state, meta = ck.restore_latest(lambda meta: target, check=lambda m: None)
    assert step == 1 and meta == {"step": 1}
    np.testing.assert_array_equal(np.asarray(state["w"]), np.ones(4))


@pytest.mark.slow
def test_an_interleaved_pipeline_checkpoint_restores_in_model_order_elsewhere(tmp_path, devices):
    # Interleaved 1F1B stores the layer stack permuted; the checkpoint records the order and a
    # run without a pipeline gets every layer (and its optimizer moments) back in model order.
    deep = ["model.num_layers=6"]
    saver = _trainer(tmp_path, devices, *deep, "mesh.pipeline=2", "mesh.fsdp=4",
                     "parallel.pipeline_schedule=interleaved_1f1b", "parallel.virtual_stages=3")
    saver.init()
    saver.run(3)
    saver.close()
    order = saver.engine.stored_layer_order
    assert order == [0, 2, 4, 1, 3, 5]  # not its own inverse: a wrong direction would show
    to_model = np.argsort(order)
    want = jax.tree_util.tree_map_with_path(
        lambda path, a: a[to_model] if "blocks" in jax.tree_util.keystr(path) and a.ndim else a, _np(saver.state))
    restorer = _trainer(tmp_path, devices, *deep, "mesh.fsdp=8")
    restorer.init()
    got = _np(restorer.state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(got.params["blocks"]["mlp"]["w_up"], _np(saver.state.params)["blocks"]["mlp"]["w_up"])
    restorer.close()


def test_resume_needs_the_whole_model_section_and_reads_records_of_older_versions():
    from dataclasses import asdict

    from spmd_train.train.checkpoint import check_same_model

    dense, moe = load_config(None, BASE), load_config(None, [*BASE, "model.preset=moe-tiny"])
    with pytest.raises(ConfigError, match=r"model.moe: checkpoint None, this run \{'every': 2"):
        check_same_model({"config": asdict(dense)}, moe, "here")
    # Not only the shapes: the model section is the model (load_from is the way to change it).
    with pytest.raises(ConfigError, match="model.rope_theta: checkpoint 10000.0, this run 500.0.*load_from"):
        check_same_model({"config": asdict(dense)}, load_config(None, [*BASE, "model.rope_theta=500.0"]), "here")
    check_same_model({"config": asdict(moe)}, load_config(None, [*BASE, "model.preset=moe-tiny",
                                                                  "backends.capacity_factor=2.0"]), "here")
    # Written before model.moe and backends existed: flat MoE keys, implementations in the model section.
    flat = {k: v for k, v in asdict(moe.model).items() if k != "moe"}
    flat.update(moe_every=2, num_experts=8, experts_per_token=2, moe_d_ff=64, router_aux_weight=0.01,
                capacity_factor=1.25, moe_impl="capacity", attention="auto", attention_blocks=None)
    check_same_model({"config": {"model": flat}}, moe, "here")
    with pytest.raises(ConfigError, match="model.moe.num_experts: checkpoint 4, this run 8"):
        check_same_model({"config": {"model": {**flat, "num_experts": 4}}}, moe, "here")
    older_dense = {k: v for k, v in asdict(dense.model).items() if k not in ("moe", "init_std")}
    check_same_model({"config": {"model": {**older_dense, "moe_every": 0}}}, dense, "here")  # missing: defaults


def test_load_from_needs_only_the_same_parameter_shapes():
    from spmd_train.train.checkpoint import check_same_parameters

    cfg = load_config(None, BASE)
    shapes = {"w": jax.ShapeDtypeStruct((4, 8), np.float32)}
    meta = {"config": {"model": {"d_model": 64}}, "param_shapes": {"['w']": [4, 8]}}
    check_same_parameters(meta, load_config(None, [*BASE, "model.rope_theta=500.0"]), shapes, "there")
    with pytest.raises(ConfigError, match=r"do not fit this model \(no model key differs\); 1 parameters differ, "
                                          r"e.g. \['w'\]: checkpoint \[4, 8\], this run \[4, 9\]"):
        check_same_parameters(meta, cfg, {"w": jax.ShapeDtypeStruct((4, 9), np.float32)}, "there")
    with pytest.raises(ConfigError, match="model.d_model: checkpoint 64, this run 32"):
        check_same_parameters(meta, load_config(None, [*BASE, "model.d_model=32"]), {}, "there")

"""Uneven pipeline stages (parallel.pipeline_layers): one device's steps, padding that stays zero, resume, bad input.

Every device of the SPMD program stores its longest chunk's rows; a shorter chunk's extra rows are padding that
the stage scan skips (`apply_blocks(rows=...)`), so they get no gradient and stay zero. An MoE model with uneven
stages is one of tests/test_pipeline_moe.py's cases.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from spmd_train import Engine, load_config
from spmd_train.config.checks import check_layout
from spmd_train.errors import ConfigError
from spmd_train.models.flops import balanced_depths
from spmd_train.sharding.arithmetic import rows_per_device
from spmd_train.train.pipelined import chunk_depths, stash_bytes_per_microbatch
from tests.runs import TINY, cli, relative_error, run_steps
from tests.tiers import fast_cases

DEEP = ["model.num_layers=8"]


@pytest.fixture(scope="module")
def reference(devices):
    losses, params, engine, _ = run_steps(["mesh.fsdp=1", *DEEP], devices[:1])
    return losses, params, engine


CASES = {
    # Stage 0 and stage 3 each hold one layer, the middle ones three: every device stores 3 rows, 4 are padding.
    "1f1b_p4": ["mesh.pipeline=4", "mesh.fsdp=2", "parallel.pipeline_layers=[1,3,3,1]"],
    # Chunks 0..3 on devices 0, 1, 0, 1: device 0 holds model chunks of 1 and 3 layers.
    "interleaved_p2_v2": ["mesh.pipeline=2", "mesh.fsdp=4", "parallel.pipeline_schedule=interleaved_1f1b",
                          "parallel.virtual_stages=2", "parallel.pipeline_layers=[1,3,3,1]"],
    # A skipped padding row under remat, with tensor parallelism inside the stage.
    "gpipe_tensor_remat": ["mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.pipeline_schedule=gpipe",
                           "parallel.pipeline_layers=[5,3]", "parallel.remat=full"],
}


@pytest.mark.parametrize("case", fast_cases(CASES, fast=["interleaved_p2_v2"]))
def test_uneven_stages_equal_one_device(reference, devices, case):
    ref_losses, ref_params, ref_engine = reference
    losses, params, engine, state = run_steps([*DEEP, *CASES[case]], devices)
    assert engine.layer_order.size > 8 and (engine.layer_order < 0).any()
    assert np.abs(losses - ref_losses).max() / np.abs(ref_losses).max() <= 1e-5, (losses, ref_losses)
    assert relative_error(engine.model_params(params), ref_params) <= 1e-5
    assert engine.num_params == ref_engine.num_params
    # Padding rows: never a gradient, so parameters and both AdamW moments stay exactly zero.
    pad = engine.layer_order < 0
    stacks = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path((state.params, state.opt_state))[0]
              if any(getattr(k, "key", None) == "blocks" for k in path) and leaf.ndim and leaf.shape[0] == pad.size]
    assert len(stacks) == 3 * len(jax.tree.leaves(params["blocks"]))
    assert all(not np.asarray(leaf)[pad].any() for leaf in stacks)
    # The unpipelined evaluation runs the model's own rows.
    batch = np.asarray(jax.random.randint(jax.random.key(1), (32, 17), 0, engine.cfg.model.vocab_size))
    assert float(engine.loss(state.params, batch)) == pytest.approx(
        float(ref_engine.loss(jax.tree.map(jax.numpy.asarray, ref_params), batch)), rel=1e-5)


def test_balanced_resolves_to_the_split_whose_costliest_chunk_costs_least(devices):
    gpt2 = [*TINY, "model.preset=gpt2-small", "mesh.pipeline=4", "mesh.fsdp=2", "train.seq_len=2048",
            "parallel.pipeline_layers=balanced"]
    depths = chunk_depths(load_config(None, gpt2), 4)
    assert depths == balanced_depths(load_config(None, gpt2).model, 2048, 4) == [3, 4, 4, 1]  # the LM head's stage
    assert chunk_depths(load_config(None, [*gpt2, "parallel.pipeline_layers=null"]), 4) == [3, 3, 3, 3]
    assert load_config(None, gpt2[:-1]).parallel.pipeline_layers is None  # the default: equal stages
    # zb_h1 splits every backward into B and W, which a padded chunk's cannot: balanced means equal there.
    assert chunk_depths(load_config(None, [*gpt2, "parallel.pipeline_schedule=zb_h1"]), 4) == [3, 3, 3, 3]
    # Layer counts the stages do not divide run, unevenly.
    six = Engine.build(load_config(None, [*TINY, "model.num_layers=6", "mesh.pipeline=4", "mesh.fsdp=2",
                                          "parallel.pipeline_layers=balanced"]), devices)
    assert sorted(chunk_depths(six.cfg, 4)) == [1, 1, 2, 2] and (six.layer_order < 0).sum() == 2


def test_a_checkpoint_reorders_between_splits_of_the_same_stored_rows_and_refuses_others(devices):
    build = lambda layers: Engine.build(load_config(None, [*TINY, *DEEP, "mesh.pipeline=4", "mesh.fsdp=2",
                                                          f"parallel.pipeline_layers={layers}"]), devices)
    a, b, c = build("[1,3,3,1]"), build("[3,1,1,3]"), build("[2,2,2,2]")
    state = a.init_state()
    moved = b.reorder_layers(state, a.stored_layer_order)
    assert relative_error(b.model_params(moved.params), a.model_params(state.params)) == 0.0
    pad = b.layer_order < 0
    assert all(not np.asarray(leaf)[pad].any() for leaf in jax.tree.leaves(moved.params["blocks"]))
    with pytest.raises(ConfigError, match="stores its layer stack in 12 rows and this run in 8"):
        c.reorder_layers(c.init_state(), a.stored_layer_order)


@pytest.mark.parametrize("overrides,needle", [
    (["parallel.pipeline_layers=[2,2,4]"], "parallel.pipeline_layers=[2, 2, 4] has 3 entries; mesh.pipeline=4 runs 4"),
    (["parallel.pipeline_layers=[0,4,2,2]"], "parallel.pipeline_layers=[0, 4, 2, 2] gives a stage chunk no layers"),
    (["parallel.pipeline_layers=[1,3,3,2]"], "parallel.pipeline_layers=[1, 3, 3, 2] sums to 9, not model.num_layers=8"),
    (["parallel.pipeline_layers=[1,3,3,1]", "parallel.pipeline_schedule=zb_h1"],
     "parallel.pipeline_layers=[1, 3, 3, 1] gives uneven stage chunks, which parallel.pipeline_schedule=zb_h1 cannot"),
], ids=["length", "zero", "sum", "zero-bubble"])
def test_bad_pipeline_layers_name_the_key(devices, overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        Engine.build(load_config(None, [*TINY, *DEEP, "mesh.pipeline=4", "mesh.fsdp=2", *overrides]), devices)


def test_moe_groups_split_by_pipeline_layers_exit_2_on_the_command_line(tmp_path):
    proc = cli("train", "configs/moe.yaml", f"run.dir={tmp_path / 'run'}", "model.num_layers=8", "mesh.pipeline=2",
               "mesh.expert=2", "mesh.fsdp=2", "parallel.pipeline_layers=[3,5]")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "parallel.pipeline_layers=[3, 5] splits an MoE group" in proc.stderr
    assert "model.moe.every=2" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_pipeline_layers_without_a_pipeline_name_the_key():
    cfg = load_config(None, [*TINY, *DEEP, "parallel.pipeline_layers=[3,5]"])
    sizes = {"data": 1, "pipeline": 1, "fsdp": 8, "sequence": 1, "expert": 1, "tensor": 1}
    with pytest.raises(ConfigError, match=r"parallel.pipeline_layers=\[3, 5\] splits the layers into stages, but "
                                          r"mesh.pipeline=1 runs one stage \(valid: balanced or null, "
                                          r"or mesh.pipeline=2\)"):
        check_layout(cfg, sizes, "cpu")
    check_layout(load_config(None, [*TINY, *DEEP, "parallel.pipeline_layers=[8]"]), sizes, "cpu")


@pytest.mark.parametrize("remat", ["none", "full"])
def test_a_padded_stage_stashes_activations_like_its_longest_chunk_and_no_weights(devices, remat):
    """Every device stores the longest chunk's 3 rows, so its stash is 3/2 of the equal split's 2 rows, and a row
    of weights never joins it (a bare `cond` made them residual copies), under remat or none."""
    def stash(layers):
        engine = Engine.build(load_config(None, [*TINY, *DEEP, "mesh.pipeline=4", "mesh.fsdp=2",
                                                 f"parallel.pipeline_layers={layers}", f"parallel.remat={remat}"]),
                              devices)
        per_row = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(engine.param_shapes["blocks"])) // 8
        rows = rows_per_device(engine.cfg, dict(engine.mesh.shape))
        return stash_bytes_per_microbatch(engine.cfg, engine.block_graphdef, engine.param_shapes["blocks"],
                                          engine.plan, rows), per_row
    (equal, row_weights), (uneven, _) = stash("[2,2,2,2]"), stash("[1,3,3,1]")
    # Beyond the rows' activations, each padded row keeps its rotary tables (the cond's outputs): a few percent.
    assert 1.5 * equal <= uneven <= 1.5 * equal * 1.1, (uneven, equal)
    assert uneven - 1.5 * equal < row_weights / 8, (uneven, equal, row_weights)

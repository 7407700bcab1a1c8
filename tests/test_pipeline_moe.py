"""MoE layers inside pipeline stages: every schedule against one device, the nested expert dispatch, bad input.

The pipelined objective is gradient accumulation's over the pipeline's microbatches (each microbatch's router
losses over its own tokens; train/pipelined.py says why no other choice is exact), so the reference is one device
with train.grad_accum = the pipeline's microbatches, which form the same rows (row r of a device goes to
microbatch r mod m either way).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from spmd_train import Engine, load_config
from spmd_train.analysis.moe_report import moe_section
from spmd_train.ops.capacity import capacity
from tests.runs import cli, relative_error
from tests.test_moe_model import CONFIG, NO_DROPS, ONE_DEVICE, _compiled_collectives, _train
from tests.tiers import fast_cases

# 8 layers = 4 MoE groups (every 2nd layer is an MoE layer): 2 stages x 2 chunks hold one group each.
BASE = [NO_DROPS, "model.num_layers=8", "train.seq_len=16", "train.global_batch_size=16"]
MICROBATCHES = 4
PIPELINED = ["mesh.pipeline=2", "mesh.expert=2", "mesh.fsdp=2", f"parallel.pipeline_microbatches={MICROBATCHES}"]
SCHEDULES = [("gpipe", 1, None), ("1f1b", 1, None), ("interleaved_1f1b", 2, None), ("zb_h1", 1, None),
             ("zb_v", 2, None),
             # Uneven stages: 1 MoE group on stage 0, 3 on stage 1 (tests/test_pipeline_uneven.py has the dense cases).
             ("1f1b", 1, "[2,6]")]
METRICS = ("loss", "grad_norm", "aux_loss", "z_loss", *(f"expert_load.{i}" for i in range(4)))


@pytest.fixture(scope="module")
def accumulated(devices):
    return _train([*BASE, *ONE_DEVICE, f"train.grad_accum={MICROBATCHES}"], devices[:1], 3)


@pytest.mark.parametrize("name,v,layers", fast_cases(SCHEDULES, fast=["1f1b-1-uneven"], several=True,
                                                     ids=lambda c: f"{c[0]}-{c[1]}" + ("-uneven" if c[2] else "")))
def test_pipeline_expert_fsdp_equals_one_device(devices, accumulated, name, v, layers):
    uneven = [] if layers is None else [f"parallel.pipeline_layers={layers}"]
    history, params, engine = _train([*BASE, *PIPELINED, f"parallel.pipeline_schedule={name}",
                                      f"parallel.virtual_stages={v}", *uneven], devices, 3)
    ref_history, ref_params, _ = accumulated
    assert engine.plan is not None and engine.plan.schedule.microbatches == MICROBATCHES
    # The router losses enter the gradients (an objective without them moves the router elsewhere) and the
    # statistics come back per MoE layer in model order, under the interleaved and V storage orders too.
    for key in METRICS:
        np.testing.assert_allclose([h[key] for h in history], [h[key] for h in ref_history], rtol=1e-5, err_msg=key)
    assert [h["dropped_fraction"] for h in history] == [h["dropped_fraction"] for h in ref_history] == [0.0] * 3
    assert relative_error(engine.model_params(params), ref_params) < 1e-5


# DeepSeek's layout: a dense first layer (model.moe.first_k_dense), then 4 MoE layers, 2 per stage.
FIRST_DENSE = [NO_DROPS, "model.moe.every=1", "model.moe.first_k_dense=1", "model.num_layers=5", "train.seq_len=16"]


@pytest.mark.parametrize("rows,microbatches", fast_cases([(16, 4), (12, 3)], fast=["16-4"], several=True,
                                                         ids=lambda c: f"{c[0]}-{c[1]}"))
def test_first_dense_layers_run_before_the_stages_each_on_its_share_of_the_rows(devices, rows, microbatches):
    # 16 rows split over fsdp 2 x expert 2 x pipeline 2 for the dense layer, whose output the stages gather along
    # `pipeline`; 12 rows do not split 8 ways, so every stage runs it on all of its 3 rows.
    common = [*FIRST_DENSE, f"train.global_batch_size={rows}"]
    ref_history, ref_params, _ = _train([*common, *ONE_DEVICE, f"train.grad_accum={microbatches}"], devices[:1], 3)
    history, params, engine = _train([*common, *PIPELINED[:-1], f"parallel.pipeline_microbatches={microbatches}",
                                      "parallel.pipeline_schedule=1f1b"], devices, 3)
    assert engine.plan is not None and "first_blocks" in params
    # The router losses are means over the 4 MoE layers, not the 5 layers.
    for key in ("loss", "grad_norm", "aux_loss", *(f"expert_load.{i}" for i in range(4))):
        np.testing.assert_allclose([h[key] for h in history], [h[key] for h in ref_history], rtol=1e-5, err_msg=key)
    assert relative_error(engine.model_params(params), ref_params) < 1e-5
    # The dense layer's output, [rows per device, seq_len, d_model] in fp32, gathered along `pipeline` when split:
    # each stage receives the other's half.
    m, t, shape = engine.cfg.model, engine.cfg.train, engine.mesh.shape
    stream = rows // (shape["fsdp"] * shape["expert"]) * t.seq_len * m.d_model * 4
    gathered = sum(c.bytes for c in _compiled_collectives(engine) if c.op == "all-gather" and c.axes == ("pipeline",))
    assert (gathered >= stream / shape["pipeline"]) == (rows % 8 == 0), (gathered, stream)


@pytest.mark.parametrize("layers,message", [
    (None, "the 3 layers after model.moe.first_k_dense=1 (model.num_layers=4) are not divisible by mesh.pipeline=2"),
    ("[2,2]", "sums to 4, not the 3 layers after model.moe.first_k_dense=1 (model.num_layers=4) (valid: 2 positive"),
    ("[1,2]", None), ("balanced", None)])
def test_stages_split_the_layers_after_the_first_dense_ones(layers, message):
    from spmd_train.config.pipeline_keys import check_pipeline
    from spmd_train.errors import ConfigError
    from spmd_train.train.pipelined import chunk_depths

    cfg = load_config(CONFIG, ["model.moe.every=1", "model.moe.first_k_dense=1", "model.num_layers=4",
                               "mesh.pipeline=2", "mesh.fsdp=1", "train.global_batch_size=8",
                               *([f"parallel.pipeline_layers={layers}"] if layers else [])])
    sizes = {**cfg.mesh.sizes(), "data": 1}
    if message is None:
        check_pipeline(cfg, sizes, 8)
        assert sum(chunk_depths(cfg, 2)) == 3 and min(chunk_depths(cfg, 2)) == 1
        return
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_pipeline(cfg, sizes, 8)


@pytest.mark.slow
def test_expert_dispatch_nests_in_the_pipeline_with_one_microbatch_groups(devices):
    # Default capacity factor: the slot buffer is sized by a group = the tokens one device holds of one pipeline
    # microbatch, and each exchange moves exactly that buffer over `expert`.
    engine = Engine.build(load_config(CONFIG, [*BASE[1:], *PIPELINED, "parallel.pipeline_schedule=1f1b"]), devices)
    cfg, mesh = engine.cfg, engine.mesh
    m, t, n = cfg.model, cfg.train, mesh.shape["expert"]
    rows = t.global_batch_size // (MICROBATCHES * mesh.shape["fsdp"] * n)
    slots = capacity(m.moe.experts_per_token, rows * t.seq_len, cfg.backends.capacity_factor, m.moe.num_experts)
    exchange = m.moe.num_experts * slots * m.d_model * 4 * (n - 1) / n
    a2a = [c for c in _compiled_collectives(engine) if c.op == "all-to-all"]
    assert [(c.axes, c.group_size) for c in a2a] == [(("expert",), n)]
    # A static count runs both branches of every tick (forward and backward), so compare bytes per exchange.
    assert a2a[0].bytes / a2a[0].count == pytest.approx(exchange)
    section = moe_section(engine)
    assert (section["group_rows"], section["group_tokens"]) == (rows, rows * t.seq_len)
    # What one device runs per step: its stage's 2 of the 4 MoE layers, 4 exchanges each per microbatch.
    assert section["all_to_all"]["count"] == 2 * MICROBATCHES * 4
    assert section["all_to_all"]["bytes_per_exchange"] == pytest.approx(exchange)


def test_moe_groups_split_across_stages_exit_2_naming_the_key(tmp_path):
    # 4 layers in groups of 2 over 2 stages x 2 chunks: a chunk would hold half a group.
    proc = cli("train", "configs/moe.yaml", f"run.dir={tmp_path / 'run'}", "mesh.pipeline=2", "mesh.expert=2",
               "mesh.fsdp=2", "parallel.pipeline_schedule=interleaved_1f1b", "parallel.virtual_stages=2")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "spmd-train: error:" in proc.stderr
    for needle in ("model.moe.every=2", "the 1 layer each pipeline stage chunk holds", "model.num_layers=4",
                   "valid model.moe.every: 1,", "a multiple of 8 layers"):
        assert needle in proc.stderr, (needle, proc.stderr)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

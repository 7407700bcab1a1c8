"""The ZeRO floor `describe` states beside the compiled bytes: its formulas, and the ratio held on a real slice."""

import math

import jax
import pytest

from spmd_train import Engine, load_config
from spmd_train.analysis import describe
from spmd_train.analysis.topology import has_libtpu
from spmd_train.analysis.zero_floor import floor_by_axes, zero_floor


def _engine(devices, *overrides):
    cfg = load_config("configs/mesh_presets.yaml", ["model.compute_dtype=bfloat16", *overrides])
    return Engine.build(cfg, devices)


def _counts(engine):
    sizes = {jax.tree_util.keystr(path): math.prod(s.shape)
             for path, s in jax.tree_util.tree_flatten_with_path(engine.param_shapes)[0]}
    return sum(sizes.values()), sizes["['embedding']"]


def test_zero3_gathers_twice_in_bf16_and_reduce_scatters_once(devices):
    engine = _engine(devices, "mesh.preset=fsdp")  # fsdp 8, ZeRO-3, untied embeddings
    assert not engine.cfg.model.tie_embeddings
    total, table = _counts(engine)
    terms = {(t.op, t.axes): t.bytes for t in zero_floor(engine)}
    # Every weight gathered forward and backward, the looked-up-only table once; bf16; (N-1)/N.
    assert terms == pytest.approx({("all-gather", ("fsdp",)): (2 * total - table) * 2 * 7 / 8,
                                   ("reduce-scatter", ("fsdp",)): total * 2 * 7 / 8})


def test_hsdp_adds_one_all_reduce_of_the_fp32_shard_over_data(devices):
    engine = _engine(devices, "mesh.preset=hsdp")  # data 2 x fsdp 4
    total, table = _counts(engine)
    terms = {(t.op, t.axes): t.bytes for t in zero_floor(engine)}
    assert terms == pytest.approx({("all-gather", ("fsdp",)): (2 * total - table) * 2 * 3 / 4,
                                   ("reduce-scatter", ("fsdp",)): total * 2 * 3 / 4,
                                   ("all-reduce", ("data",)): 2 * (total / 4 * 4) * 1 / 2})


def test_zero1_all_reduces_gradients_and_gathers_updated_fp32_parameters(devices):
    engine = _engine(devices, "mesh.preset=fsdp", "parallel.zero_stage=1")
    total, _ = _counts(engine)
    terms = {(t.op, t.axes): t.bytes for t in zero_floor(engine)}
    assert terms == pytest.approx({("all-reduce", ("fsdp",)): 2 * total * 4 * 7 / 8,
                                   ("all-gather", ("fsdp",)): total * 4 * 7 / 8})


def test_tensor_split_weights_are_counted_per_tensor_shard(devices):
    # fsdp 4 x tensor 2: every matrix is split over tensor in its compute layout except the norm scales.
    engine = _engine(devices, "mesh.preset=fsdp_tp")
    by_axes = floor_by_axes(zero_floor(engine))
    assert set(by_axes) == {("fsdp",)}
    full = floor_by_axes(zero_floor(_engine(devices[:4], "mesh.preset=fsdp", "mesh.fsdp=4")))[("fsdp",)]
    assert full / 2 < by_axes[("fsdp",)] < full / 2 * 1.01  # halved, but for the small replicated norm scales


@pytest.mark.heavy
@pytest.mark.skipif(not has_libtpu(), reason="compiles for a TPU slice: needs the tpu-aot extra")
def test_llama3_8b_zero3_over_64_chips_of_v5p_moves_close_to_the_floor():
    # The run (fsdp 64 on v5p:4x4x4, fp32 weights, bf16 compute, full remat) with 2 of the 32 layers
    # and a short sequence: weight traffic does not depend on the length. All 32 layers at 8192 tokens
    # measure 47.4 GB against a 46.4 GB floor (ratio 1.02; 149.8 GB, 3.23, without the TPU flags).
    cfg = load_config("configs/llama3-8b_v5p-512.yaml", [
        "mesh.fsdp=64", "mesh.tensor=1", "train.global_batch_size=64", "train.seq_len=256", "model.num_layers=2",
        "parallel.remat=full", "model.param_dtype=float32", "model.compute_dtype=bfloat16"])
    report = describe(cfg, topology="v5p:4x4x4")
    (row,) = report.floor_ratios()
    assert row["axes"] == ["fsdp"]
    # The remaining excess is the two vocabulary tables' gradients, still all-reduced (see docs/describe.md);
    # with 2 layers they weigh 16x more than in the full model.
    assert 1.0 < row["ratio"] < 1.15, row
    by_op = {c.op: c.bytes for c in report.collectives if c.axes == ("fsdp",)}
    floor = {t.op: t.bytes for t in report.zero_floor}
    assert by_op["all-gather"] <= floor["all-gather"]  # each weight gathered at most twice, in bf16
    assert by_op["all-reduce"] < 1.01 * 2 * (2 * 128256 * 4096 * 2) * 63 / 64  # only the two vocabulary tables

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
    # and a short sequence: weight traffic does not depend on the length. Without the TPU flags every
    # gather and reduction here is an all-reduce (ratio 3.2 for all 32 layers at 8192 tokens).
    cfg = load_config("configs/llama3-8b_v5p-512.yaml", [
        "mesh.fsdp=64", "mesh.tensor=1", "train.global_batch_size=64", "train.seq_len=256", "model.num_layers=2",
        "parallel.remat=full", "model.param_dtype=float32", "model.compute_dtype=bfloat16"])
    report = describe(cfg, topology="v5p:4x4x4")
    (row,) = report.floor_ratios()
    assert row["axes"] == ["fsdp"]
    # Below 1 here: XLA keeps the gathered LM head (outside the layer loop) alive instead of gathering it
    # again for the backward pass, which the floor counts.
    assert 0.8 < row["ratio"] <= 1.1, row
    by_op = {c.op: c.bytes for c in report.collectives if c.axes == ("fsdp",)}
    floor = {t.op: t.bytes for t in report.zero_floor}
    assert by_op["all-gather"] <= floor["all-gather"]  # each weight gathered at most twice, in bf16
    assert by_op["reduce-scatter"] == pytest.approx(floor["reduce-scatter"], rel=0.01)  # every gradient, vocab too
    assert by_op["all-reduce"] < 1e-3 * floor["reduce-scatter"]  # only norm scales and scalars


@pytest.mark.skipif(not has_libtpu(), reason="compiles for a TPU slice: needs the tpu-aot extra")
def test_vocabulary_gradients_are_scattered_along_the_vocabulary_on_tpu_only(devices):
    from jax.sharding import PartitionSpec as P

    from spmd_train.analysis.topology import tpu_topology_devices

    cfg = load_config("configs/mesh_presets.yaml", ["mesh.preset=fsdp"])
    vocab, d = cfg.model.vocab_size, cfg.model.d_model
    tpu = Engine.build(cfg, tpu_topology_devices("v5e:2x4")).layout
    # The table is stored split on its model dimension; its gradient is scattered on the vocabulary first.
    assert tpu.param_spec(P("vocab", "embed"), (vocab, d), fsdp=True) == P(None, "fsdp")
    assert tpu.vocab_scatter_spec(P("vocab", "embed"), (vocab, d)) == P(("fsdp",), None)
    assert tpu.vocab_scatter_spec(P("embed", "vocab"), (d, vocab)) == P(None, ("fsdp",))
    assert tpu.vocab_scatter_spec(P("embed", "vocab"), (d, vocab + 1)) is None  # 8 does not divide it
    assert tpu.vocab_scatter_spec(P("embed", "mlp"), (d, 4 * d)) is None  # not a vocabulary table
    assert Engine.build(cfg, devices).layout.vocab_scatter_spec(P("vocab", "embed"), (vocab, d)) is None  # CPU

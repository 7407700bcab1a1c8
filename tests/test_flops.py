"""The model-FLOP convention behind MFU, checked by hand."""

import math

import jax
import pytest

from spmd_train import Engine, Trainer, load_config
from spmd_train.hardware import device_spec
from spmd_train.models.flops import (
    active_moe_mlp_params,
    flops_per_token,
    layer_flops_per_token,
    matmul_params,
    moe_layer_count,
)


def test_llama3_8b_flops_by_hand():
    m = load_config(None, ["model.preset=llama3-8b"]).model
    # Per layer: Q and O 4096 x 4096 each, K and V 4096 x 1024 each, MLP 3 x 4096 x 14336; plus the LM head.
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    head = 4096 * 128256
    assert matmul_params(m) == 32 * per_layer + head == 7_504_658_432
    # Attention at 8k context: 6 x layers x seq x heads x head_dim (causal counted as half).
    attention = 6 * 32 * 8192 * 32 * 128
    assert flops_per_token(m, 8192) == 6 * (32 * per_layer + head) + attention == pytest.approx(5.15e10, rel=1e-3)


@pytest.mark.slow
def test_mfu_uses_the_peak_override(tmp_path, devices):
    cfg = load_config(None, ["model.preset=tiny", "train.global_batch_size=16", "train.seq_len=16",
                             "train.steps=2", "run.peak_tflops=0.5", f"run.dir={tmp_path}"])
    trainer = Trainer(cfg, devices)
    record = trainer.step()
    expected = record["tokens_per_sec_per_device"] * flops_per_token(cfg.model, 16) / 0.5e12
    assert record["mfu"] == pytest.approx(expected)
    trainer.close()


@pytest.mark.parametrize(
    ("kind", "peak"),
    [("TPU v5 lite", 197e12), ("TPU v5", 459e12), ("TPU v6 lite", 918e12), ("NVIDIA H100 80GB HBM3", 989.5e12),
     ("NVIDIA H100 PCIe", 756.5e12), ("NVIDIA H200", 989.5e12), ("TPU7x", 1153.5e12), ("cpu", None)],
)
def test_peak_table_matches_device_kinds(kind, peak):
    spec = device_spec(kind)
    assert (spec.peak_bf16_flops if spec else None) == peak


# --- mixture of experts: active parameters only ---------------------------------------------------


def test_mixtral_counts_active_parameters_by_hand():
    m = load_config(None, ["model.preset=mixtral-8x7b"]).model
    attention = 2 * 4096 * 4096 + 2 * 4096 * 1024
    # Every layer is an MoE layer: the router (d x E) and the 2 experts a token is routed to.
    moe = 4096 * 8 + 2 * 3 * 4096 * 14336
    head = 4096 * 32000
    assert moe_layer_count(m) == 32
    assert active_moe_mlp_params(m) == moe
    assert matmul_params(m) == 32 * (attention + moe) + head == 12_748_587_008
    # With the input embedding: the 12.9B "active parameters" Mixtral is quoted with.
    assert matmul_params(m) + 32000 * 4096 == pytest.approx(12.88e9, rel=1e-3)
    assert flops_per_token(m, 4096) == 6 * matmul_params(m) + 6 * 32 * 4096 * 32 * 128


def test_moe_every_other_layer_with_shared_experts_by_hand():
    m = load_config(None, ["model.preset=moe-tiny", "model.moe.num_shared_experts=2"]).model
    d, f_dense, f_expert, e, k = 64, 128, 64, 8, 2
    attention = 2 * d * d + 2 * d * (4 * 8)  # 8 query heads, 4 K/V heads of width 8
    dense_mlp = 3 * d * f_dense
    moe_mlp = d * e + 3 * d * f_expert * k + 3 * d * f_expert * 2
    assert moe_layer_count(m) == 2
    assert matmul_params(m) == 4 * attention + 2 * dense_mlp + 2 * moe_mlp + d * 256


def test_first_k_dense_layers_count_as_dense():
    m = load_config(None, ["model.preset=moe-tiny", "model.moe.every=1", "model.moe.first_k_dense=1"]).model
    d, f_dense, f_expert, e, k = 64, 128, 64, 8, 2
    attention = 2 * d * d + 2 * d * (4 * 8)
    assert moe_layer_count(m) == 3 and [m.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert matmul_params(m) == 4 * attention + 3 * d * f_dense + 3 * (d * e + 3 * d * f_expert * k) + d * 256
    per_layer = layer_flops_per_token(m, 64)
    assert per_layer[1] - per_layer[0] == 6 * d * e == per_layer[3] - per_layer[0]  # 2 experts of 64 = 128; + router
    grouped = load_config(None, ["model.preset=moe-tiny", "model.moe.first_k_dense=2"]).model
    assert [grouped.is_moe_layer(i) for i in range(4)] == [False, False, False, True]


def test_model_moe_null_is_the_dense_model():
    dense = load_config(None, ["model.preset=tiny", "model.num_layers=4"]).model
    assert moe_layer_count(dense) == 0
    off = load_config(None, ["model.preset=moe-tiny", "model.moe=null"]).model
    assert moe_layer_count(off) == 0 and matmul_params(off) == matmul_params(dense)


@pytest.mark.parametrize("overrides", [["model.preset=moe-tiny"],
                                       ["model.preset=moe-tiny", "model.moe.every=1", "model.moe.num_shared_experts=1",
                                        "model.moe.experts_per_token=1"],
                                       ["model.preset=moe-tiny", "model.moe.every=1", "model.moe.first_k_dense=1"]])
def test_active_count_matches_the_built_model(overrides):
    # From the engine's parameters: every matmul weight counts, routed-expert weights (logical axis
    # `experts`) scaled by k / E since a token meets k of the E experts; the embedding lookup and the
    # norm scales do not count.
    cfg = load_config(None, [*overrides, "mesh.fsdp=1"])
    engine = Engine.build(cfg, jax.devices()[:1])
    m = cfg.model
    logical = dict(jax.tree_util.tree_flatten_with_path(engine.logical, is_leaf=lambda x: isinstance(x, tuple))[0])
    total = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(engine.param_shapes)[0]:
        name = [str(getattr(p, "key", p)) for p in path]
        if name[0] == "embedding" or name[-1] == "scale":
            continue
        share = m.moe.experts_per_token / m.moe.num_experts if "experts" in logical[path] else 1.0
        total += math.prod(leaf.shape) * share
    assert matmul_params(m) == pytest.approx(total, rel=1e-12)

"""The Mosaic GPU (Hopper) flash-attention kernels: run by Mosaic GPU's interpreter on CPU against a
float64 reference, and lowered for CUDA (wgmma, TMA) on the CPU host."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmd_train import load_config
from spmd_train.kernels.flash_attention import BlockSizes, flash_attention
from spmd_train.ops import dot_product_attention as reference_attention
from tests.test_flash_attention import lse_loss, reference64
from tests.tiers import fast_cases

# The interpreter simulates every warpgroup, barrier and copy, slowly: a handful of cases, chosen to
# cover odd lengths, both head sizes, GQA 1/2/4, causal and not, segments, multi-tile accumulation
# and two compute warpgroups (forward and dq here, dk/dv in the log-sum-exp test below).
CASES = [  # length, head_dim, causal, groups, segmented, blocks
    (17, 64, True, 2, False, None),
    (129, 128, True, 1, False, BlockSizes(64, 64)),
    (100, 64, False, 4, True, BlockSizes(128, 64)),
]


def _gpu(q, k, v, **kwargs):
    return flash_attention(q, k, v, backend="gpu", interpret=True, **kwargs)


@pytest.mark.parametrize(("length", "head_dim", "causal", "groups", "segmented", "blocks"), fast_cases(
    CASES, fast=["17-64-True-2-False-None"], ids=lambda case: "-".join(map(str, case)), several=True))
def test_forward_and_gradients_match_float64(length, head_dim, causal, groups, segmented, blocks):
    keys = jax.random.split(jax.random.key(length + head_dim + groups), 5)
    b, kvh = 1, 1
    q = jax.random.normal(keys[0], (b, length, kvh * groups, head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, length, kvh, head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, length, kvh, head_dim), jnp.bfloat16)
    do = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
    segments = jnp.sort(jax.random.randint(keys[4], (b, length), 0, 4), axis=1) if segmented else None
    # The interpreter starts every buffer as NaN, so a block a kernel fails to write shows up.
    out, vjp = jax.vjp(lambda q, k, v: _gpu(q, k, v, causal=causal, segment_ids=segments, block_sizes=blocks),
                       q, k, v)
    grads = vjp(do)
    expected = reference64(q, k, v, do, causal, segments)
    for got, want in zip((out, *grads), expected, strict=True):
        got = np.asarray(got, np.float64)
        assert not np.isnan(got).any()
        assert np.linalg.norm(got - want) <= 2e-2 * max(np.linalg.norm(want), 1.0)
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)


def test_non_causal_with_different_lengths_and_lse_and_empty_rows():
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (1, 33, 2, 64), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, 70, 1, 64), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, 70, 1, 64), jnp.bfloat16)
    # Queries 30.. are in a segment no key has: nothing to attend to, so zeros, never NaN.
    q_seg = (jnp.arange(33) >= 30).astype(jnp.int32)[None] * 7
    segments = (q_seg, jnp.zeros((1, 70), jnp.int32))
    out, lse = _gpu(q, k, v, causal=False, segment_ids=segments, return_lse=True, block_sizes=BlockSizes(64, 64))
    expected, _, _, _ = reference64(q, k, v, np.zeros(q.shape), False, None)
    out = np.asarray(out, np.float64)
    assert np.all(out[:, 30:] == 0)
    np.testing.assert_allclose(out[:, :30], expected[:, :30], atol=3e-2)
    s = np.einsum("blhd,bmhd->bhlm", np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), 2, 2)) / 8.0
    np.testing.assert_allclose(np.asarray(lse)[:, :, :30], np.log(np.exp(s).sum(-1))[:, :, :30], rtol=1e-4)
    assert np.all(np.isfinite(np.asarray(lse)))


@pytest.mark.slow
def test_gradients_flow_through_the_log_sum_exp():
    keys = jax.random.split(jax.random.key(8), 5)
    q, k, v = (jax.random.normal(keys[i], (1, 70, 2, 64), jnp.bfloat16) for i in range(3))
    w = jax.random.normal(keys[3], q.shape)
    u = jax.random.normal(keys[4], (1, 2, 70))
    grads = [jax.grad(lse_loss, argnums=(1, 2, 3))(attend, q, k, v, w, u) for attend in (
        lambda q, k, v: _gpu(q, k, v, causal=True, return_lse=True, block_sizes=BlockSizes(64, 128)),
        lambda q, k, v: reference_attention(q, k, v, causal=True, return_lse=True))]
    for got, want in zip(*grads, strict=True):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.linalg.norm(got - want) <= 2e-2 * np.linalg.norm(want)


@pytest.mark.parametrize(
    ("shape", "dtype", "blocks", "needle"),
    [
        ((1, 64, 2, 64), jnp.float32, None, "take bfloat16 (wgmma operands); got float32 for q (1, 64, 2, 64)"),
        ((1, 64, 2, 96), jnp.bfloat16, None, "head_dim a multiple of 64; got 96 for q (1, 64, 2, 96)"),
        ((1, 64, 2, 64), jnp.bfloat16, BlockSizes(96, 128), "block_q=96: must be 64, 128, 192 or 256"),
    ],
    ids=["dtype", "head-dim", "block"],
)
def test_gpu_limits_are_clear_errors(shape, dtype, blocks, needle):
    x = jnp.zeros(shape, dtype)
    with pytest.raises(ValueError) as err:
        _gpu(x, x, x, block_sizes=blocks)
    assert needle in str(err.value)
    with pytest.raises(ValueError, match="backend='cuda' is not a flash-attention backend"):
        flash_attention(x, x, x, backend="cuda")


@pytest.mark.parametrize(("overrides", "needle"), [
    (["model.compute_dtype=float32"], "needs model.compute_dtype=bfloat16 (the kernels feed wgmma bfloat16 "
                                      "operands); got float32"),
    (["model.compute_dtype=bfloat16", "model.head_dim=32"], "head_dim that is a multiple of 64; got 32"),
    (["model.compute_dtype=bfloat16", "model.head_dim=64", "backends.attention_blocks=[128,96]"],
     "backends.attention_blocks=[128, 96] does not suit the GPU kernels: each must be 64, 128, 192 or 256"),
], ids=["dtype", "head-dim", "blocks"])
def test_the_model_config_is_checked_for_the_gpu_kernels(overrides, needle):
    from spmd_train.config.checks import check_attention
    from spmd_train.errors import ConfigError

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml",
                      ["backends.attention=pallas", *overrides])
    with pytest.raises(ConfigError) as err:
        check_attention(cfg, "gpu")
    assert needle in str(err.value)
    check_attention(cfg, "tpu")  # the TPU kernels take any dtype and head_dim


@pytest.mark.parametrize(("causal", "segmented", "head_dim"), [(True, False, 128), (False, True, 64)])
def test_kernels_lower_for_hopper(causal, segmented, head_dim):
    """Forward and backward go through Mosaic GPU's whole lowering for sm_90 (layouts, TMA
    descriptors, wgmma shapes) on the CPU host; what is left for the GPU is PTX assembly."""
    b, length, h, kvh = 2, 2048, 8, 2

    def loss(q, k, v, seg):
        out = flash_attention(q, k, v, causal=causal, segment_ids=seg if segmented else None,
                              backend="gpu", interpret=False)
        return jnp.sum(out.astype(jnp.float32))

    q = jax.ShapeDtypeStruct((b, length, h, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, length, kvh, head_dim), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((b, length), jnp.int32)
    exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=("cuda",))(q, kv, kv, seg)
    text = exported.mlir_module()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 3  # forward, dq, dk/dv
    assert text.count(f"wgmma.mma_async.sync.aligned.m64n{head_dim}k16.f32.bf16.bf16") >= 3  # P V, dS K, dS^T Q
    assert "cp.async.bulk.tensor" in text  # K/V stream in by TMA


@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU (Hopper)")
@pytest.mark.parametrize(("length", "causal", "groups", "segmented"),
                         [(1000, True, 4, False), (2048, True, 1, True), (777, False, 2, False)])
def test_compiled_on_the_gpu_matches_float64(length, causal, groups, segmented):
    """On a Hopper GPU: the compiled kernels (real wgmma, TMA, barriers) against float64."""
    keys = jax.random.split(jax.random.key(length), 5)
    q = jax.random.normal(keys[0], (2, length, 2 * groups, 128), jnp.bfloat16)
    k = jax.random.normal(keys[1], (2, length, 2, 128), jnp.bfloat16)
    v = jax.random.normal(keys[2], (2, length, 2, 128), jnp.bfloat16)
    do = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
    segments = jnp.sort(jax.random.randint(keys[4], (2, length), 0, 4), axis=1) if segmented else None
    run = jax.jit(lambda q, k, v, do: jax.vjp(
        lambda q, k, v: flash_attention(q, k, v, causal=causal, segment_ids=segments), q, k, v)[1](do))
    out = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=causal, segment_ids=segments))(q, k, v)
    expected = reference64(q, k, v, do, causal, segments)
    for got, want in zip((out, *run(q, k, v, do)), expected, strict=True):
        got = np.asarray(got, np.float64)
        assert not np.isnan(got).any()
        assert np.linalg.norm(got - want) <= 2e-2 * np.linalg.norm(want)

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
from spmd_train.ops.attention import Scoring
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


VARIANTS = {  # length, kv length, query offset, window, soft-cap, blocks, groups, documents
    "window_under_a_block_capped_documents": (130, 130, 0, 10, 3.0, BlockSizes(64, 64), 1, True),
    "window_not_a_block_multiple_documents": (200, 200, 0, 70, None, BlockSizes(128, 64), 1, True),
    "soft_cap": (100, 100, 0, None, 2.0, BlockSizes(64, 64), 1, False),
    "window_capped_chunk_at_an_offset": (64, 192, 128, 90, 2.0, BlockSizes(64, 64), 2, False),
}


@pytest.mark.parametrize("case", fast_cases(VARIANTS, fast=["window_under_a_block_capped_documents"]))
def test_windows_soft_caps_and_offsets_match_the_reference(case):
    """Forward, log-sum-exp and every gradient (through the output and the log-sum-exp, as context-parallel merges
    take them) against the XLA reference in fp32 on the same bf16 inputs. Windows under a block and across blocks,
    one and two compute warpgroups, packed documents, and a query chunk at an offset behind its keys' end."""
    lq, lk, offset, window, softcap, blocks, groups, documents = VARIANTS[case]
    rng = np.random.default_rng(lq + lk)
    q = jnp.asarray(rng.normal(size=(1, lq, groups, 64)) * 2, jnp.bfloat16)  # scale 2: the cap bites
    k, v = (jnp.asarray(rng.normal(size=(1, lk, 1, 64)) * 2, jnp.bfloat16) for _ in range(2))
    w, u = jnp.asarray(rng.normal(size=q.shape), jnp.bfloat16), jnp.asarray(rng.normal(size=(1, groups, lq)))
    seg = jnp.asarray(np.sort(rng.integers(0, 3, (1, lq)), axis=1), jnp.int32) if documents else None
    ours = lambda q, k, v: _gpu(q, k, v, segment_ids=seg, block_sizes=blocks, window=window, softcap=softcap,
                                q_offset=offset, return_lse=True)
    reference = lambda q, k, v: reference_attention(q, k, v, segment_ids=seg, scoring=Scoring(softcap=softcap,
                                                    window=window), q_offset=offset, return_lse=True)
    # Cotangents for the output and the log-sum-exp: gradients of sum(out * w) + sum(lse * u).
    (out, lse), vjp = jax.vjp(ours, q, k, v)
    (want_out, want_lse), want_vjp = jax.vjp(reference, *(x.astype(jnp.float32) for x in (q, k, v)))
    grads, want_grads = vjp((w, u)), want_vjp((w.astype(jnp.float32), u))
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=2e-2, rtol=2e-3)
    for got, want in zip((out, *grads), (want_out, *want_grads), strict=True):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert not np.isnan(got).any()
        assert np.linalg.norm(got - want) <= 2e-2 * np.linalg.norm(want)


def test_a_window_bounds_the_tiles_each_kernel_streams(monkeypatch):
    """The pipelines' trip counts scale with the window: counted where the compute warpgroups receive each streamed
    tile, in the interpreter, a one-token window at 192 tokens streams 3 tiles per kernel (its band) where causal
    attention streams 6; at 8192 tokens in 128 x 128 blocks a 1024 window streams the tiles its band touches,
    0.26x of causal attention's."""
    from jax import lax
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from spmd_train.kernels.flash_attention.gpu_kernel import kv_tiles, q_tiles
    from spmd_train.kernels.flash_attention.kernel import KernelPlan

    streamed, kernels, pipeline = [], [], plgpu.emit_pipeline_warp_specialized

    def counting(step, **kwargs):  # the forward's, then dq's, then dk/dv's pipeline
        kernel = len(kernels)
        kernels.append(kernel)

        def counted(indices, *rest):
            jax.debug.callback(lambda wg: streamed.append(kernel) if int(wg) == 0 else None, lax.axis_index("wg"))
            return step(indices, *rest)
        return pipeline(counted, **kwargs)

    monkeypatch.setattr(plgpu, "emit_pipeline_warp_specialized", counting)
    q = jnp.ones((1, 192, 1, 64), jnp.bfloat16)
    out, vjp = jax.vjp(lambda q, k, v: _gpu(q, k, v, window=1, block_sizes=BlockSizes(64, 64)), q, q, q)
    jax.block_until_ready(vjp(out))
    assert [streamed.count(kernel) for kernel in kernels] == [3, 3, 3]  # full causal: 1 + 2 + 3 each

    def tiles(window):
        plan = KernelPlan(scale=1.0, causal=True, block_q=128, block_k=128, q_len=8192, kv_len=8192, groups=1,
                          interpret=False, gpu=True, window=window)
        return (sum(kv_tiles(i, plan, 64)[1] for i in range(64)), sum(q_tiles(i, plan, 128, 64)[1] for i in range(64)))

    pos = np.arange(8192)
    band = (pos[:, None] >= pos[None]) & (pos[:, None] - pos[None] < 1024)  # [query, key]
    touched = (band.reshape(64, 128, 64, 128).any((1, 3)).sum(), band.T.reshape(64, 128, 128, 64).any((1, 3)).sum())
    assert tiles(1024) == touched == (540, 1080) and tiles(None) == (64 * 65 // 2, 4160)


@pytest.mark.slow
def test_mla_widths_sinks_and_a_window_through_the_dispatch_on_the_gpu_kernels():
    """The model's entry point on the GPU kernels: DeepSeek's 192-wide queries and keys against 128-wide values
    (zero-padded to 192 outside the kernels), sinks through the log-sum-exp and a window with a cap, against the
    reference with the values as they are, output and every gradient (sinks' included)."""
    from spmd_train.parallel.attention_dispatch import attention
    from spmd_train.parallel.backends import Backends

    rng = np.random.default_rng(5)
    q, k = (jnp.asarray(rng.normal(size=(1, 70, 2, 192)), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(1, 70, 2, 128)), jnp.bfloat16)
    sinks, w = jnp.asarray([0.5, -1.0], jnp.float32), jnp.asarray(rng.normal(size=(1, 70, 2, 128)), jnp.bfloat16)
    scoring = Scoring(softcap=5.0, window=20)
    backends = Backends(platform="gpu", attention="pallas", kernels="gpu", interpret=True, blocks=(128, 64))
    ours = lambda q, k, v, sinks: attention(q, k, v, backends=backends, scoring=scoring, sinks=sinks)
    reference = lambda q, k, v, sinks: reference_attention(q, k, v, scoring=scoring, sinks=sinks)
    out, vjp = jax.vjp(ours, q, k, v, sinks)
    want, want_vjp = jax.vjp(reference, *(x.astype(jnp.float32) for x in (q, k, v)), sinks)
    for got, expected in zip((out, *vjp(w)), (want, *want_vjp(w.astype(jnp.float32))), strict=True):
        got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
        assert got.shape == expected.shape and not np.isnan(got).any()
        assert np.linalg.norm(got - expected) <= 2e-2 * np.linalg.norm(expected)


@pytest.mark.parametrize(
    ("shape", "dtype", "blocks", "needle"),
    [
        ((1, 64, 2, 64), jnp.float32, None, "take bfloat16 (wgmma operands); got float32 for q (1, 64, 2, 64)"),
        ((1, 64, 2, 96), jnp.bfloat16, None, "head_dim a multiple of 64; got 96 for q (1, 64, 2, 96)"),
        ((1, 64, 2, 64), jnp.bfloat16, BlockSizes(96, 128), "block_q=96: must be 64, 128, 192 or 256"),
        ((1, 128, 2, 192), jnp.bfloat16, BlockSizes(128, 128), "GPU blocks 128 x 128 at head_dim 192 need 295 KiB of "
         "shared memory, over Hopper's 227 KiB: use block_sizes=BlockSizes(block_q=128, block_k=64)"),
    ],
    ids=["dtype", "head-dim", "block", "shared-memory"],
)
def test_gpu_limits_are_clear_errors(shape, dtype, blocks, needle):
    x = jnp.zeros(shape, dtype)
    with pytest.raises(ValueError) as err:
        _gpu(x, x, x, block_sizes=blocks)
    assert needle in str(err.value)
    with pytest.raises(ValueError, match="backend='cuda' is not a flash-attention backend"):
        flash_attention(x, x, x, backend="cuda")


@pytest.mark.parametrize(("overrides", "needle"), [
    (["model.compute_dtype=float32"], "needs model.compute_dtype (precision.compute)=bfloat16 (the kernels feed "
                                      "wgmma bfloat16 operands); got float32"),
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


def test_the_gpu_kernels_take_windows_soft_caps_and_sinks_in_the_model_config():
    from spmd_train.config.checks import check_attention

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml", [
        "backends.attention=pallas", "model.compute_dtype=bfloat16", "model.head_dim=64", "model.sliding_window=8",
        "model.layer_types=[sliding,full]", "model.attn_logit_softcap=30.0", "model.attention_sinks=true"])
    check_attention(cfg, "gpu")


@pytest.mark.parametrize(("causal", "segmented", "head_dim", "variants"), [
    (True, False, 128, {}), (False, True, 64, {}),
    (True, True, 192, {"window": 1000, "softcap": 50.0}),  # MLA's padded width (default blocks 128 x 64)
], ids=["causal", "segments", "window-softcap-192"])
def test_kernels_lower_for_hopper(causal, segmented, head_dim, variants):
    """Forward and backward go through Mosaic GPU's whole lowering for sm_90 (layouts, TMA
    descriptors, wgmma shapes, shared memory) on the CPU host; what is left for the GPU is PTX assembly."""
    b, length, h, kvh = 2, 2048, 8, 2

    def loss(q, k, v, seg):
        out = flash_attention(q, k, v, causal=causal, segment_ids=seg if segmented else None,
                              backend="gpu", interpret=False, **variants)
        return jnp.sum(out.astype(jnp.float32))

    q = jax.ShapeDtypeStruct((b, length, h, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, length, kvh, head_dim), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((b, length), jnp.int32)
    exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=("cuda",))(q, kv, kv, seg)
    text = exported.mlir_module()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 3  # forward, dq, dk/dv
    assert text.count(f"wgmma.mma_async.sync.aligned.m64n{head_dim}k16.f32.bf16.bf16") >= 3  # P V, dS K, dS^T Q
    assert "cp.async.bulk.tensor" in text  # K/V stream in by TMA
    assert ("tanh.approx.f32" in text) == ("softcap" in variants)  # the cap's tanh, one instruction


@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU (Hopper)")
@pytest.mark.parametrize(("length", "causal", "groups", "segmented", "window", "softcap"), [
    (1000, True, 4, False, None, None), (2048, True, 1, True, None, None), (777, False, 2, False, None, None),
    (4096, True, 2, True, 1000, None),  # a window across blocks (not a multiple of 128), documents
    (1000, True, 4, False, 100, 30.0),  # a window under one block, soft-capped
])
def test_compiled_on_the_gpu_matches_float64(length, causal, groups, segmented, window, softcap):
    """On a Hopper GPU: the compiled kernels (real wgmma, TMA, barriers) against float64."""
    keys = jax.random.split(jax.random.key(length), 5)
    q = jax.random.normal(keys[0], (2, length, 2 * groups, 128), jnp.bfloat16)
    k = jax.random.normal(keys[1], (2, length, 2, 128), jnp.bfloat16)
    v = jax.random.normal(keys[2], (2, length, 2, 128), jnp.bfloat16)
    do = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
    segments = jnp.sort(jax.random.randint(keys[4], (2, length), 0, 4), axis=1) if segmented else None
    attend = lambda q, k, v: flash_attention(q, k, v, causal=causal, segment_ids=segments, window=window,
                                             softcap=softcap)
    run = jax.jit(lambda q, k, v, do: jax.vjp(attend, q, k, v)[1](do))
    out = jax.jit(attend)(q, k, v)
    expected = reference64(q, k, v, do, causal, segments, window=window, softcap=softcap)
    for got, want in zip((out, *run(q, k, v, do)), expected, strict=True):
        got = np.asarray(got, np.float64)
        assert not np.isnan(got).any()
        assert np.linalg.norm(got - want) <= 2e-2 * np.linalg.norm(want)

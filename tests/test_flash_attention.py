"""Pallas flash attention (interpret mode on CPU) against a float64 reference, and its TPU compile."""

import importlib
import itertools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmd_train.kernels.flash_attention import BlockSizes, flash_attention
from spmd_train.kernels.flash_attention.kernel import poisoned_outputs
from spmd_train.ops import dot_product_attention as reference_attention
from tests.tiers import fast_cases


def reference64(q, k, v, do, causal, segments, window=None, softcap=None):
    """Forward and gradients in float64 numpy, written from the definitions (with a causal `window`: q_pos - k_pos <
    window; with `softcap`: scores softcap * tanh(scores / softcap))."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    b, lq, h, d = q.shape
    lk, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # head j uses K/V head j // g
    s = np.einsum("blhd,bmhd->bhlm", q, kr) / np.sqrt(d)
    slope = 1.0
    if softcap is not None:
        t = np.tanh(s / softcap)
        s, slope = softcap * t, 1.0 - t * t  # d capped / d scores
    mask = np.ones((b, 1, lq, lk), bool)
    if causal:
        mask &= np.tril(np.ones((lq, lk), bool))
    if window is not None:
        mask &= ~np.tril(np.ones((lq, lk), bool), -window)  # q_pos - k_pos >= window is masked
    if segments is not None:
        seg = np.asarray(segments)
        mask &= seg[:, None, :, None] == seg[:, None, None, :]
    s = np.where(mask, s, -np.inf)
    m = np.max(s, -1, keepdims=True)
    p = np.where(mask, np.exp(s - np.where(np.isfinite(m), m, 0)), 0.0)
    den = p.sum(-1, keepdims=True)
    p = p / np.where(den == 0, 1, den)
    out = np.einsum("bhlm,bmhd->blhd", p, vr)
    dp = np.einsum("blhd,bmhd->bhlm", do, vr)
    ds = p * (dp - np.einsum("blhd,blhd->bhl", do, out)[..., None]) * slope
    dq = np.einsum("bhlm,bmhd->blhd", ds, kr) / np.sqrt(d)
    dk = np.einsum("bhlm,blhd->bmhd", ds, q).reshape(b, lk, kvh, g, d).sum(3) / np.sqrt(d)
    dv = np.einsum("bhlm,blhd->bmhd", p, do).reshape(b, lk, kvh, g, d).sum(3)
    return out, dq, dk, dv


def test_the_float64_reference_windows_and_caps_like_the_xla_reference():
    """reference64's window and soft-cap (the compiled GPU kernels' yardstick) against ops.dot_product_attention."""
    from spmd_train.ops.attention import Scoring

    rng = np.random.default_rng(1)
    q, k, v, do = (jnp.asarray(rng.normal(size=(1, 40, 2, 8)) * 3, jnp.float32) for _ in range(4))
    seg = jnp.asarray(np.sort(rng.integers(0, 2, (1, 40)), axis=1), jnp.int32)
    out, vjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, segment_ids=seg,
                                                           scoring=Scoring(window=7, softcap=2.0)), q, k, v)
    for got, want in zip(reference64(q, k, v, do, True, seg, window=7, softcap=2.0), (out, *vjp(do)), strict=True):
        np.testing.assert_allclose(got, np.asarray(want, np.float64), atol=1e-4, rtol=1e-4)


GRID = list(itertools.product([1, 17, 129, 384], [64, 128], [True, False], [1, 2, 4], [False, True]))
CASES = random.Random(2026).sample(GRID, 14)
BLOCKS = [BlockSizes(32, 32), BlockSizes(64, 32), BlockSizes(128, 64), BlockSizes(16, 128)]
# bf16 over the same cases but the three 384-long grouped ones, whose shapes f32 covers and which cost 3-4x their
# f32 twins in the interpreter (XLA:CPU's bf16 dots): bf16 still runs at 384 (two ungrouped cases) and with
# groups, head width 128 and without the causal mask (at 129).
BF16_CASES = [case for case in CASES if not (case[0] == 384 and case[3] > 1)]


@pytest.mark.parametrize(("dtype", "length", "head_dim", "causal", "groups", "segmented"), fast_cases(
    [(jnp.float32, *case) for case in CASES] + [(jnp.bfloat16, *case) for case in BF16_CASES],
    fast=["f32-129-128-True-4-True", "f32-17-64-True-4-False", "f32-384-64-True-1-True", "f32-129-128-False-4-True",
          "bf16-1-128-True-2-True"],
    ids=lambda case: "-".join(["f32" if case[0] == jnp.float32 else "bf16", *map(str, case[1:])]), several=True))
def test_forward_and_gradients_match_float64(dtype, length, head_dim, causal, groups, segmented):
    seed = hash((length, head_dim, causal, groups, segmented)) % 2**31
    keys = jax.random.split(jax.random.key(seed), 5)
    b, kvh = 2, 2
    q = jax.random.normal(keys[0], (b, length, kvh * groups, head_dim), dtype)
    k = jax.random.normal(keys[1], (b, length, kvh, head_dim), dtype)
    v = jax.random.normal(keys[2], (b, length, kvh, head_dim), dtype)
    do = jax.random.normal(keys[3], q.shape, dtype)
    segments = None
    if segmented:  # packed documents; row 0 of batch 1 forms a segment of its own
        segments = jnp.sort(jax.random.randint(keys[4], (b, length), 0, 4), axis=1)
    blocks = BLOCKS[seed % len(BLOCKS)]
    with poisoned_outputs():
        out, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, causal=causal, segment_ids=segments,
                                                           block_sizes=blocks), q, k, v)
        grads = vjp(do)
    expected = reference64(q, k, v, do, causal, segments)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for got, want in zip((out, *grads), expected, strict=True):
        got = np.asarray(got, np.float64)
        assert not np.isnan(got).any()
        # Relative error; a gradient that is exactly zero (length 1: softmax of one key) is judged absolutely.
        assert np.linalg.norm(got - want) <= tol * max(np.linalg.norm(want), 1.0)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)


def test_non_causal_with_different_lengths_and_lse():
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (1, 33, 4, 64))
    k = jax.random.normal(keys[1], (1, 70, 2, 64))
    v = jax.random.normal(keys[2], (1, 70, 2, 64))
    out, lse = flash_attention(q, k, v, causal=False, return_lse=True, block_sizes=BlockSizes(16, 32))
    expected, _, _, _ = reference64(q, k, v, np.zeros(q.shape), False, None)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    s = np.einsum("blhd,bmhd->bhlm", np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), 2, 2)) / 8.0
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), rtol=1e-5)


def lse_loss(attend, q, k, v, w, u):
    """A loss through both the output and the log-sum-exp, as merging blockwise results has."""
    out, lse = attend(q, k, v)
    return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(lse * u)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gradients_flow_through_the_log_sum_exp(causal):
    keys = jax.random.split(jax.random.key(7), 5)
    q = jax.random.normal(keys[0], (2, 45, 4, 64))
    k = jax.random.normal(keys[1], (2, 45, 2, 64))
    v = jax.random.normal(keys[2], (2, 45, 2, 64))
    w = jax.random.normal(keys[3], q.shape)
    u = jax.random.normal(keys[4], (2, 4, 45))
    ours = jax.grad(lse_loss, argnums=(1, 2, 3))(
        lambda q, k, v: flash_attention(q, k, v, causal=causal, return_lse=True, block_sizes=BlockSizes(16, 32)),
        q, k, v, w, u)
    ref = jax.grad(lse_loss, argnums=(1, 2, 3))(
        lambda q, k, v: reference_attention(q, k, v, causal=causal, return_lse=True), q, k, v, w, u)
    for got, want in zip(ours, ref, strict=True):
        assert np.linalg.norm(np.asarray(got) - np.asarray(want)) <= 1e-5 * np.linalg.norm(np.asarray(want))


def test_rows_with_nothing_to_attend_give_zeros_not_nan():
    q = jnp.ones((1, 8, 2, 64))
    kv = jnp.ones((1, 8, 2, 64))
    # Segments differ on every position of q and k: every row is fully masked.
    segments = (jnp.zeros((1, 8), jnp.int32), jnp.ones((1, 8), jnp.int32))
    out, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, causal=False, segment_ids=segments), q, kv, kv)
    grads = vjp(jnp.ones_like(out))
    assert np.all(np.asarray(out) == 0) and all(np.all(np.asarray(g) == 0) for g in grads)


@pytest.mark.parametrize(
    ("shapes", "kwargs", "needle"),
    [
        (((1, 8, 4, 64), (1, 8, 2, 32), (1, 8, 2, 32)), {}, "head_dim must agree"),
        (((1, 8, 4, 64), (1, 8, 3, 64), (1, 8, 3, 64)), {}, "must divide q heads"),
        (((1, 8, 4, 64), (1, 8, 2, 64), (1, 8, 2, 64)), {"segment_ids": jnp.zeros((1, 7), jnp.int32)},
         "segment_ids must be [batch, length]"),
        (((1, 8, 4, 64), (1, 9, 2, 64), (1, 9, 2, 64)), {}, "causal attention needs equal"),
    ],
    ids=["head-dim", "gqa", "segments", "causal-lengths"],
)
def test_bad_input_names_the_shapes(shapes, kwargs, needle):
    q, k, v = (jnp.zeros(s) for s in shapes)
    with pytest.raises(ValueError) as err:
        flash_attention(q, k, v, **kwargs)
    assert needle in str(err.value) and str(shapes[0]) in str(err.value)


def test_unsupported_dtype():
    x = jnp.zeros((1, 8, 2, 64), jnp.float16)
    with pytest.raises(ValueError, match="float16; supported: float32, bfloat16"):
        flash_attention(x, x, x)


def test_inside_the_model_pallas_matches_xla(devices):
    from tests.runs import relative_error, run_steps

    xla, xla_params, _, _ = run_steps(["mesh.fsdp=2", "mesh.tensor=4", "backends.attention=xla"], devices)
    pallas, pallas_params, _, _ = run_steps(["mesh.fsdp=2", "mesh.tensor=4", "backends.attention=pallas"], devices)
    assert np.max(np.abs(pallas - xla) / np.abs(xla)) <= 1e-5
    assert relative_error(pallas_params, xla_params) <= 1e-5


def test_model_attention_blocks_reach_the_kernels(devices, monkeypatch):
    module = importlib.import_module("spmd_train.parallel.attention_backends.pallas_backend")
    from tests.runs import run_steps

    seen = []

    def spy(q, k, v, **kwargs):
        seen.append(kwargs["block_sizes"])
        return flash_attention(q, k, v, **kwargs)

    monkeypatch.setattr(module, "flash_attention", spy)
    xla, _, _, _ = run_steps(["mesh.fsdp=2", "mesh.tensor=4", "backends.attention=xla"], devices, steps=2)
    pallas, _, _, _ = run_steps(["mesh.fsdp=2", "mesh.tensor=4", "backends.attention=pallas",
                                 "backends.attention_blocks=[8,16]"], devices, steps=2)
    assert seen and set(seen) == {BlockSizes(8, 16)}  # 16 tokens: two row blocks, one K/V block each
    assert np.max(np.abs(pallas - xla) / np.abs(xla)) <= 1e-5


def test_inside_the_model_under_grad_accumulation_shard_map(devices):
    from tests.runs import run_steps

    xla, _, _, _ = run_steps(["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=4", "train.grad_accum=2",
                              "backends.attention=xla"], devices, steps=2)
    pallas, _, _, _ = run_steps(["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=4", "train.grad_accum=2",
                                 "backends.attention=pallas"], devices, steps=2)
    assert np.max(np.abs(pallas - xla) / np.abs(xla)) <= 1e-5


@pytest.mark.tpu_aot
@pytest.mark.parametrize("length", [2048, pytest.param(32768, marks=pytest.mark.slow)])
def test_kernels_compile_for_tpu_inside_shard_map(length):
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from spmd_train.analysis import tpu_topology_devices
    from spmd_train.analysis.hlo import matmul_flops

    mesh = Mesh(np.array(tpu_topology_devices("v5e:2x2")).reshape(2, 2), ("data", "tensor"),
                axis_types=(AxisType.Explicit,) * 2)
    spec = P("data", None, "tensor", None)

    def loss(q, k, v):
        out = jax.shard_map(lambda q, k, v: flash_attention(q, k, v, causal=True, interpret=False), mesh=mesh,
                            in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)(q, k, v)
        return jnp.sum(out.astype(jnp.float32))

    # 32k tokens: 8x beyond what fit in VMEM before K/V were tiled over the grid.
    q = jax.ShapeDtypeStruct((4, length, 8, 128), jnp.bfloat16, sharding=NamedSharding(mesh, spec))
    kv = jax.ShapeDtypeStruct((4, length, 4, 128), jnp.bfloat16, sharding=NamedSharding(mesh, spec))
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile().as_text()
    assert text.count("tpu_custom_call") == 3  # forward, dq, dk/dv: Mosaic kernels, not XLA fallbacks
    # describe's FLOP count sees inside the kernels: per device 2 x 4 heads, 512-blocks, causal
    # (1 + 2 + ... + n visible block pairs), 2 + 3 + 4 block matmuls of 2 x 512 x 512 x 128.
    n = length // 512
    assert matmul_flops(text) == 9 * 2 * (2 * 4) * (n * (n + 1) // 2) * 512 * 512 * 128


def test_vmem_does_not_grow_with_length_and_oversized_blocks_fall_back_clearly():
    from spmd_train.config.model_schema import BackendsConfig, ModelConfig
    from spmd_train.kernels.flash_attention import TPU_VMEM_BUDGET, BlockSizes, tpu_vmem_bytes
    from spmd_train.parallel import resolve_backends

    short = tpu_vmem_bytes((1, 2048, 4, 128), (1, 2048, 1, 128), jnp.bfloat16)
    long = tpu_vmem_bytes((1, 131072, 4, 128), (1, 131072, 1, 128), jnp.bfloat16)
    assert short == long <= TPU_VMEM_BUDGET // 4
    huge = BlockSizes(8192, 8192)
    assert tpu_vmem_bytes((1, 65536, 4, 128), (1, 65536, 1, 128), jnp.bfloat16, huge) > TPU_VMEM_BUDGET
    model = ModelConfig(num_heads=4, num_kv_heads=1, head_dim=128, compute_dtype="bfloat16")
    auto = BackendsConfig()
    fits = resolve_backends(model, auto, "tpu", (1, 65536, 4, 128), (1, 65536, 1, 128))
    assert (fits.attention, fits.kernels, fits.blocks, fits.interpret) == ("pallas", "tpu", (512, 512), False)
    falls_back = resolve_backends(model, BackendsConfig(attention_blocks=(8192, 8192)), "tpu",
                                  (1, 65536, 4, 128), (1, 65536, 1, 128))
    assert falls_back.attention == "xla" and "over the 32 MiB budget" in falls_back.reason
    assert resolve_backends(model, auto, "cpu").attention == "xla"
    assert resolve_backends(model, auto, "gpu").attention == "cudnn"
    forced = resolve_backends(model, BackendsConfig(attention="pallas"), "cpu")
    assert (forced.attention, forced.interpret, forced.blocks) == ("pallas", True, (128, 128))
    x = jnp.zeros((1, 65536, 4, 128), jnp.bfloat16)
    kv = jnp.zeros((1, 65536, 1, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="MiB of TPU VMEM.*smaller block_sizes"):
        flash_attention(x, kv, kv, block_sizes=huge, interpret=False)

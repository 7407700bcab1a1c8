"""The reference attention's variants (sliding windows, soft-capping, sinks, query scale, offsets, narrower
values) against a per-element numpy softmax, and the sink correction every other path uses against the
reference's own sinks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmd_train.ops.attention import Scoring, dot_product_attention, with_sinks
from tests.tiers import fast_cases


def _naive(q, k, v, *, causal, window, softcap, scale, q_offset, segments, sinks):
    """One query row at a time, in float64: the definition in the module docstring, spelled out."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, lq, h, _ = q.shape
    lk, kvh = k.shape[1], k.shape[2]
    out = np.zeros((b, lq, h, v.shape[3]))
    lse = np.full((b, h, lq), -np.inf)
    for bi in range(b):
        for hi in range(h):
            kh = hi // (h // kvh)
            for i in range(lq):
                qp = i + q_offset
                keys = [j for j in range(lk)
                        if (not causal or j <= qp) and (window is None or qp - j < window)
                        and (segments is None or segments[bi, i] == segments[bi, j])]
                logits = [scale * q[bi, i, hi] @ k[bi, j, kh] for j in keys]
                if softcap is not None:
                    logits = [softcap * np.tanh(x / softcap) for x in logits]
                terms = list(logits) + ([float(sinks[hi])] if sinks is not None else [])
                if not terms:
                    continue
                top = max(terms)
                total = sum(np.exp(x - top) for x in terms)
                lse[bi, hi, i] = top + np.log(total)
                for x, j in zip(logits, keys, strict=True):
                    out[bi, i, hi] += np.exp(x - lse[bi, hi, i]) * v[bi, j, kh]
    return out, lse


CASES = {
    "window": {"window": 3},
    "window_softcap_scale": {"window": 4, "softcap": 2.0, "scale": 0.3},
    "sinks": {"sinks": True},
    "window_sinks_documents": {"window": 3, "sinks": True, "documents": True},
    "offset_past_block": {"window": 6, "q_offset": 5, "lq": 5, "causal": False},
    "offset_diagonal_narrow_values": {"window": 4, "q_offset": 3, "lq": 6, "dv": 3},
}


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_the_definition(case):
    c = CASES[case]
    rng = np.random.default_rng(0)
    lq, lk, h, kvh, d = c.get("lq", 9), 9, 4, 2, 8
    q = rng.normal(size=(2, lq, h, d)).astype(np.float32) * 2
    k = rng.normal(size=(2, lk, kvh, d)).astype(np.float32) * 2
    v = rng.normal(size=(2, lk, kvh, c.get("dv", d))).astype(np.float32)
    segments = np.array([[0] * 4 + [1] * 5, [0] * 7 + [1] * 2]) if c.get("documents") else None
    sinks = rng.normal(size=h).astype(np.float32) if c.get("sinks") else None
    scale = c.get("scale")
    kw = {"causal": c.get("causal", True), "q_offset": c.get("q_offset", 0)}
    out, lse = dot_product_attention(
        q, k, v, segment_ids=None if segments is None else jnp.asarray(segments), return_lse=True,
        scoring=Scoring(scale=scale, softcap=c.get("softcap"), window=c.get("window")),
        sinks=None if sinks is None else jnp.asarray(sinks), **kw)
    want, want_lse = _naive(q, k, v, window=c.get("window"), softcap=c.get("softcap"),
                            scale=scale if scale is not None else d**-0.5, segments=segments, sinks=sinks, **kw)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=2e-5)


def test_sinks_applied_after_the_keys_equal_sinks_in_the_softmax_with_gradients():
    """`with_sinks` (what kernels and context-parallel merges use) equals the reference's own sink column,
    in value and in every gradient (q, k, v and the sinks)."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((2, 8, 4, 8), (2, 8, 2, 8), (2, 8, 2, 8)))
    sinks = jnp.asarray(rng.normal(size=4), jnp.float32)
    segments = jnp.asarray([[0] * 3 + [1] * 5, [0] * 8])
    scoring = Scoring(window=3, softcap=3.0)

    def direct(q, k, v, sinks):
        return dot_product_attention(q, k, v, segment_ids=segments, scoring=scoring, sinks=sinks)

    def corrected(q, k, v, sinks):
        return with_sinks(*dot_product_attention(q, k, v, segment_ids=segments, scoring=scoring, return_lse=True),
                          sinks)

    cot = jnp.asarray(rng.normal(size=(2, 8, 4, 8)), jnp.float32)
    loss = lambda f: lambda *a: jnp.sum(f(*a) * cot)
    np.testing.assert_allclose(corrected(q, k, v, sinks), direct(q, k, v, sinks), atol=1e-6)
    for got, want in zip(jax.grad(loss(corrected), argnums=(0, 1, 2, 3))(q, k, v, sinks),
                         jax.grad(loss(direct), argnums=(0, 1, 2, 3))(q, k, v, sinks), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_bad_scoring_names_the_value():
    with pytest.raises(ValueError, match="window=0"):
        Scoring(window=0)
    with pytest.raises(ValueError, match="softcap=-1"):
        Scoring(softcap=-1.0)


KERNEL_CASES = {
    # (lq, lk, window, softcap, q_offset, blocks, documents)
    "window_softcap_documents": (64, 64, 10, 3.0, 0, (16, 16), True),
    "window_under_one_block": (48, 48, 3, None, 0, (16, 8), False),
    "past_chunk_at_an_offset": (32, 32, 40, 2.0, 32, (8, 16), False),
}


@pytest.mark.parametrize("case", fast_cases(KERNEL_CASES, fast=["window_softcap_documents"]))
def test_tpu_kernels_compute_windows_caps_and_offsets_like_the_reference(case):
    """The Pallas TPU kernels (interpreted), forward, log-sum-exp and every gradient, against the reference."""
    from spmd_train.kernels.flash_attention import BlockSizes, flash_attention
    from spmd_train.kernels.flash_attention.kernel import poisoned_outputs

    lq, lk, window, softcap, offset, blocks, documents = KERNEL_CASES[case]
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(size=(2, lq, 4, 16)) * 2, jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, lk, 2, 16)) * 2, jnp.float32) for _ in range(2))
    seg = None
    if documents:
        seg = jnp.asarray(np.sort(rng.integers(0, 3, (2, lq)), axis=1), jnp.int32)
    w, u = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((2, lq, 4, 16), (2, 4, lq)))

    def loss(attend):
        def f(q, k, v):
            out, lse = attend(q, k, v)
            return jnp.sum(out * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * u)
        return f

    kernel = lambda q, k, v: flash_attention(q, k, v, segment_ids=seg, block_sizes=BlockSizes(*blocks),
                                             return_lse=True, window=window, softcap=softcap, q_offset=offset,
                                             interpret=True, backend="tpu")
    reference = lambda q, k, v: dot_product_attention(q, k, v, segment_ids=seg, return_lse=True, q_offset=offset,
                                                      scoring=Scoring(softcap=softcap, window=window))
    with poisoned_outputs():
        got, got_grads = jax.value_and_grad(loss(kernel), argnums=(0, 1, 2))(q, k, v)
        out, lse = kernel(q, k, v)
    want, want_grads = jax.value_and_grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
    want_out, want_lse = reference(q, k, v)
    np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, r in zip(got_grads, want_grads, strict=True):
        assert not np.isnan(np.asarray(g)).any()
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4)


def test_a_window_bounds_the_kernel_grid_and_the_pairs_it_computes():
    """8192 tokens in 512-wide blocks: a 1024 window's grid walks 4 of 16 K/V blocks per row block and computes the
    diagonal block and the two before it (45 pairs, a third of full causal's 136); at any offset the pairs computed
    are the brute-force count of blocks that hold a visible entry."""
    from spmd_train.kernels.flash_attention.kernel import KernelPlan, band_steps, visible_pairs

    plan = KernelPlan(scale=1.0, causal=True, block_q=512, block_k=512, q_len=8192, kv_len=8192, groups=4,
                      interpret=False, window=1024)
    assert band_steps(plan, 16, 16) == (4, 4)
    full = visible_pairs(KernelPlan(**{**plan.__dict__, "window": None}), 16, 16)
    assert full == 16 * 17 // 2 and visible_pairs(plan, 16, 16) == 16 + 15 + 14
    small = KernelPlan(scale=1.0, causal=True, block_q=16, block_k=8, q_len=64, kv_len=64, groups=1,
                       interpret=True, window=11, q_offset=24)
    rows, cols = np.arange(64)[:, None] + 24, np.arange(64)[None, :]
    seen = (cols <= rows) & (rows - cols < 11)
    brute = sum(seen[i * 16:(i + 1) * 16, j * 8:(j + 1) * 8].any() for i in range(4) for j in range(8))
    assert visible_pairs(small, 4, 8) == brute

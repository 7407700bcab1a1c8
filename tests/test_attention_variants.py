"""The reference attention's variants (sliding windows, soft-capping, sinks, query scale, offsets, narrower
values) against a per-element numpy softmax, and the sink correction every other path uses against the
reference's own sinks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmd_train.ops.attention import Scoring, dot_product_attention, with_sinks


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

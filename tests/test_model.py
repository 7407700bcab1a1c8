"""The model on its own: attention semantics, causality, remat, presets' sizes, mixed precision."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmd_train import load_config
from spmd_train.models.transformer import Transformer
from spmd_train.ops import cross_entropy, dot_product_attention
from tests.runs import relative_error, run_steps
from tests.tiers import fast_cases


def _model(*overrides):
    cfg = load_config(None, ["model.preset=tiny", *overrides]).model
    return Transformer(cfg, rngs=nnx.Rngs(0))


def _naive_attention(q, k, v):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    s = np.einsum("blhd,bmhd->bhlm", q, k) / np.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones((q.shape[1], k.shape[1]), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhlm,bmhd->blhd", p, v)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_grouped_query_attention_matches_repeated_kv(groups):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, 17, 4 * groups, 16))
    k = jax.random.normal(kk, (2, 17, 4, 16))
    v = jax.random.normal(kv, (2, 17, 4, 16))
    out = dot_product_attention(q, k, v, causal=True)
    np.testing.assert_allclose(out, _naive_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_logits_are_causal():
    model = _model()
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 256)
    changed = tokens.at[:, 7:].set((tokens[:, 7:] + 1) % 256)
    a, b = model(tokens), model(changed)
    np.testing.assert_array_equal(a[:, :7], b[:, :7])
    assert not np.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize("policy", fast_cases(["full", "save_matmuls", "save_matmuls_no_batch"], fast=["full"]))
def test_remat_policies_keep_loss_and_gradients(policy):
    model = _model()
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    tokens = jax.random.randint(jax.random.key(2), (2, 9), 0, 256)

    def loss(p, remat):
        return cross_entropy(nnx.merge(graphdef, p)(tokens[:, :-1], remat=remat), tokens[:, 1:])

    ref_loss, ref_grads = jax.value_and_grad(loss)(params, "none")
    got_loss, got_grads = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, policy)
    assert abs(float(got_loss) - float(ref_loss)) < 1e-6
    assert relative_error(got_grads, ref_grads) < 1e-5


def test_tied_embeddings_drop_the_head():
    untied = nnx.to_pure_dict(nnx.state(_model()))
    tied = nnx.to_pure_dict(nnx.state(_model("model.tie_embeddings=true")))
    assert "lm_head" in untied and "lm_head" not in tied


def test_cross_entropy_matches_log_softmax():
    logits = jax.random.normal(jax.random.key(3), (2, 5, 11))
    targets = jax.random.randint(jax.random.key(4), (2, 5), 0, 11)
    expected = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))
    assert abs(float(cross_entropy(logits, targets)) - float(expected)) < 1e-6


@pytest.mark.parametrize(
    ("preset", "expected"),
    [("gpt2-small", 123.5e6), ("llama-1b", 1.236e9), ("llama3-8b", 8.03e9)],
)
def test_preset_parameter_counts(preset, expected):
    cfg = load_config(None, [f"model.preset={preset}"]).model
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract)))
    assert count == pytest.approx(expected, rel=0.01)


# The published totals and active counts (the model cards and papers the presets cite). Active here is the planner's
# 6N convention: every matrix a token passes through, the LM head included and the looked-up table not.
MOE_PRESETS = {
    "deepseek-v3-671b": (671.0e9, 36.6e9),  # "671B total, 37B activated" (its MTP module's 14B left out)
    "deepseek-v2-236b": (235.74e9, 20.85e9),  # "236B total parameters, of which 21B are activated"
    "deepseek-v2-lite": (15.7e9, 2.45e9),  # "15.7B total, 2.4B activated"
    "qwen3-30b-a3b": (30.5e9, 3.04e9),  # "30.5B in total and 3.3B activated", of which 0.31B the embedding table
    "qwen3-235b-a22b": (235.1e9, 21.6e9),  # "235B in total and 22B activated", of which 0.62B the embedding table
    "gpt-oss-20b": (20.91e9, 3.61e9),  # "21B parameters with 3.6B active"
    "gpt-oss-120b": (116.83e9, 5.13e9),  # "117B parameters with 5.1B active"
}


@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_fine_grained_moe_presets_have_their_published_sizes(preset):
    from spmd_train.analysis.plan.shape import ModelShape

    cfg = load_config(None, [f"model.preset={preset}"]).model
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract)))
    total, active = MOE_PRESETS[preset]
    shape = ModelShape.from_config(cfg)
    assert count == shape.total_params == pytest.approx(total, rel=2e-3)
    assert shape.active_params == pytest.approx(active, rel=5e-3)


# Gemma 3 Technical Report (arXiv:2503.19786), Table 1: non-embedding parameters of the text models. Its embedding
# column (302M, 675M, 1,012M, 1,416M) is within 0.6% of vocab_size x d_model, which the test holds exactly.
GEMMA3_PRESETS = {"gemma3-1b": 698e6, "gemma3-4b": 3209e6, "gemma3-12b": 10759e6, "gemma3-27b": 25600e6}


@pytest.mark.parametrize("preset", GEMMA3_PRESETS)
def test_gemma3_presets_have_their_published_sizes(preset):
    from spmd_train.analysis.plan.shape import ModelShape

    cfg = load_config(None, [f"model.preset={preset}"]).model
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract)))
    assert count == ModelShape.from_config(cfg).total_params
    table = cfg.vocab_size * cfg.d_model
    assert count - table == pytest.approx(GEMMA3_PRESETS[preset], rel=1e-3)
    assert cfg.layer_kinds[:6] == ("sliding",) * 5 + ("full",)


@pytest.mark.slow
def test_bfloat16_compute_tracks_float32(devices):
    f32, _, _, _ = run_steps(["mesh.fsdp=2", "mesh.tensor=4"], devices)
    bf16, params, _, _ = run_steps(["mesh.fsdp=2", "mesh.tensor=4", "model.compute_dtype=bfloat16"], devices)
    assert np.allclose(bf16, f32, rtol=2e-2)
    assert all(p.dtype == np.float32 for p in jax.tree.leaves(params))  # fp32 master weights

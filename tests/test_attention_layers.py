"""The model's attention variants end to end: sliding and full layers mixed, RoPE per layer kind, sinks, soft-caps
and the query scale train alike on one device and on sharded and context-parallel meshes, a sliding layer sees
only its window, generation with a cache equals recomputation, and the combinations not run are refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmd_train import Engine, load_config
from spmd_train.config.checks import check_layout
from spmd_train.config.model_schema import BackendsConfig, ModelConfig
from spmd_train.errors import ConfigError
from spmd_train.models.flops import flops_per_token
from spmd_train.models.transformer import Transformer
from spmd_train.parallel.backends import resolve_backends
from spmd_train.train.generation import generate
from tests.runs import FP32, relative_error, run_steps, token_files, tpu_attention_flops
from tests.test_generate import PROMPTS, _params, _recomputed
from tests.tiers import fast_cases

VARIANTS = ["model.num_layers=4", "model.layer_types=[sliding,full]", "model.sliding_window=5",
            "model.rope_local_theta=500.0", "model.attention_sinks=true", "model.attn_logit_softcap=3.0",
            "model.final_logit_softcap=8.0", "model.query_pre_attn_scalar=16.0", "model.attn_output_bias=true", *FP32]
"""Every variant at once on the tiny model: two sliding layers of window 5 (of 16 tokens) between full ones, with
gpt-oss's sinks and attention output bias."""

LAYOUTS = {
    "data2_fsdp2_tensor2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
    "fsdp2_tensor4_sp": ["mesh.fsdp=2", "mesh.tensor=4", "parallel.sequence_parallel=true"],
    "allgather_sequence4": ["mesh.fsdp=2", "mesh.sequence=4", "parallel.context_parallel=allgather"],
    "ulysses_sequence4": ["mesh.fsdp=2", "mesh.sequence=4", "parallel.context_parallel=ulysses"],
    "documents_allgather": ["mesh.fsdp=2", "mesh.sequence=4", "parallel.context_parallel=allgather"],
    "documents_pallas_allgather": ["mesh.fsdp=2", "mesh.sequence=4", "parallel.context_parallel=allgather",
                                   "backends.attention=pallas", "backends.attention_blocks=[8,8]"],
    "documents_pallas_tensor2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "backends.attention=pallas",
                                 "backends.attention_blocks=[8,8]"],
}


@pytest.fixture(scope="module")
def reference(devices):
    losses, params, _, _ = run_steps(["mesh.fsdp=1", *VARIANTS], devices[:1])
    # The sinks and the output bias start at 0 and learn: their gradients reach them (so the equalities below are not
    # of zeros).
    assert np.abs(_sinks(params)).max() > 1e-4
    (bias,) = [a for path, a in jax.tree_util.tree_leaves_with_path(params)
               if any(getattr(entry, "key", None) == "bo" for entry in path[-2:])]
    assert np.abs(np.asarray(bias)).max() > 1e-4
    return losses, params


@pytest.mark.parametrize("layout", fast_cases(LAYOUTS, fast=["data2_fsdp2_tensor2"]))
def test_every_variant_trains_on_a_sharded_mesh_like_one_device(reference, devices, layout, corpus):
    overrides = [*LAYOUTS[layout], *VARIANTS]
    if layout.startswith("documents"):  # packed documents masked: their own one-device run
        documents = [*token_files(corpus), "data.document_mask=true"]
        overrides += documents
        ref_losses, ref_params, _, _ = run_steps(["mesh.fsdp=1", *VARIANTS, *documents], devices[:1])
    else:
        ref_losses, ref_params = reference
    losses, params, _, _ = run_steps(overrides, devices)
    assert abs(losses - ref_losses).max() / abs(ref_losses).max() <= 1e-5, (losses, ref_losses)
    assert relative_error(params, ref_params) <= 2e-5


PIPELINES = {
    # Chunk 0 holds one sliding layer, chunk 1 full, sliding, full: the short chunk's padding rows have kinds too.
    "gpipe_uneven_p2": ["mesh.pipeline=2", "mesh.fsdp=4", "parallel.pipeline_schedule=gpipe",
                        "parallel.pipeline_layers=[1,3]"],
    "interleaved_p2_v2": ["mesh.pipeline=2", "mesh.fsdp=4", "parallel.pipeline_schedule=interleaved_1f1b",
                          "parallel.virtual_stages=2"],
    "zb_v_p2": ["mesh.pipeline=2", "mesh.fsdp=4", "parallel.pipeline_schedule=zb_v", "parallel.virtual_stages=2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", PIPELINES)
def test_pipelines_run_mixed_layers_like_one_device(reference, devices, case):
    """Each stage chunk runs its own layers' kinds (full and sliding alternate, so every chunk of two or more layers
    mixes them), under fused, interleaved and split-backward schedules."""
    ref_losses, ref_params = reference
    losses, params, engine, _ = run_steps([*PIPELINES[case], *VARIANTS], devices)
    assert abs(losses - ref_losses).max() / abs(ref_losses).max() <= 1e-5, (losses, ref_losses)
    assert relative_error(engine.model_params(params), ref_params) <= 2e-5


@pytest.mark.parametrize("kernel", fast_cases(["xla", "pallas", "xla_documents"], fast=["xla_documents"]))
def test_ring_attention_runs_every_variant_like_one_device(devices, kernel, corpus):
    """Full layers go round the ring, sliding ones swap their neighbours' tails (`parallel.halo`): 32 tokens over
    sequence=2 are 4 zigzag chunks of 8, and a window of 6 reaches 5 keys into the chunk before."""
    longer = [*VARIANTS, "model.sliding_window=6", "train.seq_len=32", "train.global_batch_size=16"]
    if kernel.endswith("documents"):
        longer += [*token_files(corpus), "data.document_mask=true"]
    ref_losses, ref_params, _, _ = run_steps(["mesh.fsdp=1", *longer], devices[:1])
    blocks = ["backends.attention=pallas", "backends.attention_blocks=[8,8]"] if kernel == "pallas" else []

    losses, params, _, _ = run_steps(["mesh.fsdp=4", "mesh.sequence=2", "parallel.context_parallel=ring",
                                      *longer, *blocks], devices)
    assert abs(losses - ref_losses).max() / abs(ref_losses).max() <= 1e-5
    assert relative_error(params, ref_params) <= 2e-5


def _is_sinks(path) -> bool:
    return any(getattr(entry, "key", None) == "sinks" for entry in path[-2:])


def _sinks(params) -> np.ndarray:
    """The stacked sink logits [layers, heads] of a parameter tree."""
    found = [np.asarray(a) for path, a in jax.tree_util.tree_leaves_with_path(params) if _is_sinks(path)]
    assert len(found) == 1
    return found[0]


def _logits(overrides, tokens):
    cfg = load_config(None, ["model.preset=tiny", "train.seq_len=16", *FP32, *overrides])
    model = Transformer(cfg.model, rngs=nnx.Rngs(0))
    return np.asarray(jax.jit(lambda t: model(t))(tokens))


def test_a_sliding_layer_sees_only_its_window():
    """Two sliding layers of window 4 reach 2 x 3 tokens back: changing token 0 moves the logits of positions 0-6
    and of no later one; with full layers it moves the last one too."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, 16)), jnp.int32)
    changed = tokens.at[0, 0].set((tokens[0, 0] + 1) % 256)
    sliding = ["model.num_layers=2", "model.sliding_window=4"]
    moved = np.abs(_logits(sliding, tokens) - _logits(sliding, changed)).max(axis=-1)[0]
    assert (moved[:7] > 1e-6).all() and (moved[7:] == 0).all(), moved
    full = np.abs(_logits(["model.num_layers=2"], tokens) - _logits(["model.num_layers=2"], changed)).max(-1)[0]
    assert full[-1] > 1e-6


def test_final_soft_cap_bounds_the_logits():
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 16)), jnp.int32)
    capped = _logits(["model.final_logit_softcap=0.5", "model.init_std=1.0"], tokens)
    plain = _logits(["model.init_std=1.0"], tokens)
    assert np.abs(plain).max() > 1.0 and np.abs(capped).max() <= 0.5
    np.testing.assert_allclose(capped, 0.5 * np.tanh(plain / 0.5), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_generation_with_a_cache_equals_recomputation(devices):
    cfg = load_config(None, ["model.preset=tiny", "train.global_batch_size=8", "train.seq_len=16", *VARIANTS,
                             "model.sliding_window=3", "mesh.fsdp=2", "mesh.tensor=4"])
    engine = Engine.build(cfg, list(devices))
    # Sinks of -2 to 2 (not their initial 0), so generation must get them right too.
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: jnp.linspace(-2, 2, a.size).reshape(a.shape).astype(a.dtype) if _is_sinks(path) else a,
        _params(engine))
    assert np.abs(_sinks(params)).max() == 2
    result = generate(engine, params, PROMPTS, max_new_tokens=6)
    assert result.tokens == _recomputed(engine, params, PROMPTS, 6)


def test_windows_count_as_the_band_they_compute():
    m = ModelConfig(num_layers=2, d_model=64, num_heads=8, num_kv_heads=4)
    windowed = ModelConfig(num_layers=2, d_model=64, num_heads=8, num_kv_heads=4, sliding_window=1024,
                           layer_types=("sliding", "full"))
    full_layer = flops_per_token(m, 8192) / 2 - flops_per_token(m, 0) / 2
    band = (1024 - 1024**2 / (2 * 8192)) / (8192 / 2)  # keys per query against full causal's
    assert flops_per_token(windowed, 8192) - flops_per_token(m, 0) == pytest.approx(full_layer * (1 + band))


@pytest.mark.parametrize(("platform", "overrides", "chosen", "why"), [
    ("tpu", {"attn_logit_softcap": 30.0, "sliding_window": 128, "attention_sinks": True}, "pallas", "VMEM"),
    ("gpu", {"attn_logit_softcap": 30.0, "compute_dtype": "bfloat16", "head_dim": 64}, "pallas",
     "model.attn_logit_softcap"),
    ("gpu", {"attn_logit_softcap": 30.0}, "xla", "model.attn_logit_softcap"),  # float32: our GPU kernels take bf16
    ("gpu", {"sliding_window": 128}, "cudnn", "auto: cudnn"),
    ("gpu", {"attention_sinks": True, "compute_dtype": "bfloat16", "head_dim": 64}, "pallas", "model.attention_sinks"),
])
def test_auto_picks_an_implementation_that_computes_the_variants(platform, overrides, chosen, why):
    got = resolve_backends(ModelConfig(**overrides), BackendsConfig(), platform)
    assert got.attention == chosen and why in got.reason


REFUSED = {
    "sliding_without_window": (["model.layer_types=[sliding,full]"], "model.sliding_window is null"),
    "window_without_sliding": (["model.layer_types=[full]", "model.sliding_window=4"], "no layer slides"),
    "local_rope_without_sliding": (["model.rope_local_theta=10.0"], "model.rope_local_theta=10.0"),
    "too_many_types": (["model.layer_types=[full,full,full]"], "more than model.num_layers=2"),
    "cudnn_sinks": (["backends.attention=cudnn", "model.attention_sinks=true"], "model.attention_sinks"),
    "ring_window_past_a_chunk": (["model.sliding_window=5", "mesh.sequence=4", "parallel.context_parallel=ring",
                                  "train.seq_len=16"], "model.sliding_window=5 reaches past the 2-token chunk"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_combinations_not_run_are_refused_naming_the_keys(case):
    overrides, message = REFUSED[case]
    with pytest.raises(ConfigError, match=message):
        cfg = load_config(None, ["model.preset=tiny", *overrides])
        sizes = {**cfg.mesh.sizes(), "fsdp": 1}
        check_layout(cfg, sizes, "gpu" if "cudnn" in case or "gpu" in case else "cpu")


# --- Hugging Face config.json: which layers slide, both ways ---------------------------------------------------------


def _qwen2(**fields):
    return {"model_type": "qwen2", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "attention_bias": True, **fields}


@pytest.mark.parametrize(("fields", "window", "types"), [
    ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2}, 64,
     ("full", "full", "sliding", "sliding")),
    ({"use_sliding_window": True, "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"] * 2},
     64, ("sliding", "full", "sliding", "full")),
    ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 4}, None, None),  # no layer slides
    ({"use_sliding_window": False, "sliding_window": 64}, None, None),
])
def test_imported_layer_types_follow_the_checkpoint_and_export_back(fields, window, types):
    from spmd_train.config.hf_config import hf_config, model_section

    section = model_section(_qwen2(**fields))
    assert section["sliding_window"] == window and section.get("layer_types") == types
    model = ModelConfig(**section)
    assert model_section(hf_config(model, _qwen2(**fields), dtype="float32")) == section


def test_export_refuses_what_no_family_holds():
    from spmd_train.config.hf_config import hf_config

    for fields, named in (({"attn_logit_softcap": 50.0}, "model.attn_logit_softcap=50.0"),
                          ({"attention_sinks": True}, "model.attention_sinks=True"),
                          ({"sliding_window": 8, "layer_types": ("sliding", "full")}, "Mistral's config.json has no")):
        with pytest.raises(ConfigError, match=named):
            hf_config(ModelConfig(**fields), dtype="float32")


def test_a_windowed_ring_layer_sends_its_neighbours_the_window_not_the_ring(devices):
    """Compiled forward and backward over sequence=4 with 8 query heads on 2 K/V heads of 16 and 256 tokens (zigzag
    chunks of 32): a window of 8 moves 2 x 7 keys and values each way per device; the full ring moves 3 whole
    blocks of 64 keys and values, and its gradients back, about 20x the bytes."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from spmd_train.analysis.hlo import parse_collectives
    from spmd_train.ops.attention import Scoring
    from spmd_train.parallel.attention_dispatch import local_kernel
    from spmd_train.parallel.backends import Backends
    from spmd_train.parallel.context import context_attention

    n, b, length, h, kvh, d = 4, 1, 256, 8, 2, 16
    mesh = Mesh(np.array(devices[:n]), ("sequence",))
    split = P(None, "sequence")
    kernel = local_kernel(Backends(platform="cpu", attention="xla"))
    shapes = [jax.ShapeDtypeStruct((b, length, heads, d), jnp.float32) for heads in (h, kvh, kvh)]

    def sent(window):
        attend = lambda q, k, v: context_attention(q, k, v, None, how="ring", ways=n, kernel=kernel,
                                                   scoring=Scoring(window=window))
        sharded = jax.shard_map(attend, mesh=mesh, in_specs=(split,) * 3, out_specs=split, check_vma=False)
        step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(sharded(q, k, v)), argnums=(0, 1, 2)))
        ops = parse_collectives(step.lower(*shapes).compile().as_text(), n)
        assert {op.kind for op in ops} == {"collective-permute"}
        return sum(op.bytes_per_execution * op.executions for op in ops)

    halo = sent(8)
    # Forward: 7 keys and 7 values (2 heads x 16, fp32) and 7 segment ids up and down; backward: the keys' and
    # values' gradients home again.
    kv_tail = 7 * kvh * d * 4
    assert halo == 2 * (2 * kv_tail + 7 * 4) + 2 * 2 * kv_tail
    assert sent(None) > 15 * halo


def test_a_sliding_layers_cache_does_not_grow_with_the_generated_length():
    """Generating 1k or 8k tokens: the sliding layers' cache is the same window-sized ring; the full layers' grows."""
    from spmd_train.models.decode import cache_shapes

    m = ModelConfig(num_layers=6, sliding_window=128, layer_types=("sliding",) * 5 + ("full",))
    short, long = cache_shapes(m, 4, 1024 + 16), cache_shapes(m, 4, 8192 + 16)
    assert short.k_local.shape == long.k_local.shape == (5, 4, 128, m.num_kv_heads, m.resolved_head_dim)
    assert (short.k.shape[0], short.k.shape[2], long.k.shape[2]) == (1, 1040, 8208)


@pytest.mark.tpu_aot
def test_describe_counts_a_windowed_layers_kernel_flops_on_a_tpu_slice():
    """Compiled for v5e:2x2 at 2048 tokens in 512 x 512 blocks: full causal attention runs 10 block pairs per head,
    a 512-token window 7 (each row block's own and the one before it), and describe's compiled attention FLOPs
    scale exactly so; the model count scales by the band's area."""
    def attention(extra):
        return tpu_attention_flops(2048, extra)

    (full, full_model), (window, window_model) = attention([]), attention(["model.sliding_window=512"])
    assert window / full == pytest.approx(7 / 10, rel=1e-9)
    assert window_model / full_model == pytest.approx((512 - 512**2 / 4096) / 1024, rel=1e-9)

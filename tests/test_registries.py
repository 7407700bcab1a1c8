"""The four registries (model families, attention implementations, pipeline schedules, optimizers): every entry
registered is complete, its jax-free facts and its code agree, and it does what its facts say.

docs/howto/ has one page per registry; an entry added there is checked here without editing this file.
"""

from __future__ import annotations

import itertools
import math
import typing
from dataclasses import replace
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmd_train import load_config
from spmd_train.analysis.plan.candidate import Candidate, Workload
from spmd_train.analysis.plan.memory import state_bytes
from spmd_train.analysis.plan.shape import ModelShape
from spmd_train.analysis.render import _bubble_formula
from spmd_train.cli.schedule import schedule_report
from spmd_train.config.attention_facts import PLATFORMS, attention_facts, attention_names, fallback_attention
from spmd_train.config.families import families
from spmd_train.config.hf_config import VARIANTS, hf_config, infer_family, model_section
from spmd_train.config.load import model_from_record
from spmd_train.config.mesh_schema import ScheduleName
from spmd_train.config.model_schema import AttentionImpl, BackendsConfig, MLAConfig, ModelConfig, MoEConfig
from spmd_train.config.optimizer_facts import MOMENT_KEYS, optimizer_facts, optimizer_names
from spmd_train.config.schedule_facts import PLACEMENTS, schedule_facts, schedule_names
from spmd_train.config.train_schema import OptimizerName
from spmd_train.config.validity import schedule_request, virtual_stages_fit
from spmd_train.errors import ConfigError
from spmd_train.hf.names import pieces
from spmd_train.models.transformer import Transformer
from spmd_train.ops.attention import dot_product_attention
from spmd_train.parallel.attention_backends import attention_backend, registered_attention
from spmd_train.parallel.backends import resolve_backends
from spmd_train.parallel.pipeline_schedules import registered_orders
from spmd_train.parallel.schedule_simulator import simulate
from spmd_train.parallel.schedules import build_schedule
from spmd_train.train.optimizer import hyperparameters, make_optimizer
from spmd_train.train.optimizers import registered_optimizers

# --- pipeline schedules ---------------------------------------------------------------------------------------------


def test_every_schedule_has_facts_and_an_op_order_and_the_schema_lists_them():
    assert set(registered_orders()) == set(schedule_names())
    assert typing.get_args(ScheduleName) == schedule_names()


def _requests(name: str):
    """Small (stages, microbatches, virtual) the schedule's facts accept: the fewest microbatches and twice that."""
    facts = schedule_facts(name)
    virtuals = sorted({facts.min_virtual, facts.max_virtual or facts.min_virtual + 1})
    for p, v in itertools.product((2, 4), virtuals):
        least = p if facts.fill or facts.groups else 1
        for m in (least, 2 * p):
            yield p, m, v


@pytest.mark.parametrize("name", schedule_names())
def test_each_schedule_builds_simulates_and_attains_its_stated_bubble(name):
    facts = schedule_facts(name)
    assert facts.placement in PLACEMENTS and facts.min_virtual >= 1
    assert facts.max_virtual is None or facts.max_virtual >= facts.min_virtual
    for p, m, v in _requests(name):
        assert schedule_request(name, p, m, v) is None, (p, m, v)
        schedule = build_schedule(name, p, m, v)
        stats = simulate(schedule)  # every op once, on the stage its placement gives, after its inputs
        kinds = {op.kind for row in schedule.ticks for op in row if op is not None}
        assert kinds == ({"F", "B", "W"} if facts.split_backward else {"F", "B"})
        assert schedule.split_backward == facts.split_backward and schedule.placement == facts.placement
        closed = Fraction(p - 1, (3 if facts.split_backward else 1) * v * m + p - 1)
        if facts.bubble_exact:
            assert stats.bubble_fraction == pytest.approx(float(closed)), (p, m, v)
        else:
            assert stats.bubble_fraction >= float(closed) - 1e-12, (p, m, v)
    assert "{" not in facts.unit_bubble.format(p1=1, p3=3)
    assert _bubble_formula(name).endswith("+p-1)") and name in schedule_report(name, 2, 4)


@pytest.mark.parametrize("name", schedule_names())
def test_each_schedule_refuses_chunks_outside_its_range(name):
    low, high = schedule_facts(name).min_virtual, schedule_facts(name).max_virtual
    outside = {v for v in (low - 1, (high or 0) + 1) if v >= 1 and not (low <= v and (high is None or v <= high))}
    assert outside  # every schedule has a count of chunks it refuses (1 at least, or 2)
    for v in sorted(outside):
        found = virtual_stages_fit(name, v)
        assert found is not None and f"parallel.virtual_stages={v}" in found.message
        with pytest.raises(ConfigError, match=name):
            build_schedule(name, 2, 4, v)


# --- attention implementations --------------------------------------------------------------------------------------


def test_every_attention_implementation_in_the_schema_has_facts_and_a_kernel():
    assert typing.get_args(AttentionImpl) == ("auto", *attention_names())
    assert set(registered_attention()) == set(attention_names())
    assert [n for n in attention_names() if attention_facts(n).fallback] == [fallback_attention()]
    assert attention_facts(fallback_attention()).platforms == PLATFORMS


@pytest.mark.parametrize("name", attention_names())
def test_each_attention_implementation_computes_attention_where_it_runs_and_is_refused_elsewhere(name):
    facts = attention_facts(name)
    assert set(facts.platforms) <= set(PLATFORMS) and facts.label
    model = ModelConfig(num_layers=1, d_model=64, num_heads=4, num_kv_heads=2, d_ff=64, vocab_size=256)
    choice = BackendsConfig(attention=name, attention_blocks=(8, 8))
    for platform in PLATFORMS:
        if platform not in facts.platforms:
            assert facts.needs
            with pytest.raises(ConfigError, match=rf"backends.attention={name} needs .* devices are {platform}"):
                resolve_backends(model, choice, platform)
    if "cpu" not in facts.platforms:
        return
    backends = resolve_backends(model, choice, "cpu")
    kernel = attention_backend(name).kernel(backends)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 16, heads, 16)), jnp.float32) for heads in (4, 2, 2))
    segments = jnp.asarray([[0] * 5 + [1] * 11], jnp.int32)
    want, want_lse = dot_product_attention(q, k, v, causal=True, segment_ids=segments, return_lse=True)
    np.testing.assert_allclose(kernel(q, k, v, segments, True, False), want, rtol=1e-5, atol=1e-5)
    if facts.returns_lse:
        out, lse = kernel(q, k, v, segments, True, True)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


# --- optimizers -----------------------------------------------------------------------------------------------------


def test_every_optimizer_in_the_schema_has_facts_and_a_transformation():
    assert typing.get_args(OptimizerName) == optimizer_names()
    assert set(registered_optimizers()) == set(optimizer_names())


def _cases():
    for name in optimizer_names():
        yield name, None
        if optimizer_facts(name).b1_adds_state:
            yield name, 0.9


@pytest.mark.parametrize(("name", "b1"), list(_cases()))
def test_each_optimizers_planner_state_bytes_are_optax_state(name, b1):
    # Dimensions of 128 and more, so that factored moments (Adafactor) are factored.
    cfg = load_config(None, ["model.preset=tiny", "model.d_model=256", "model.d_ff=512", f"optim.name={name}",
                             *([f"optim.b1={b1}"] if b1 is not None else [])])
    facts = optimizer_facts(name)
    assert set(hyperparameters(cfg.optim)) == {k for k, _ in facts.defaults}
    assert sorted([k for k, _ in facts.defaults] + [k for k, _ in facts.not_applicable]) == sorted(MOMENT_KEYS)
    model = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    params = nnx.to_pure_dict(state)
    logical = nnx.to_pure_dict(jax.tree.map(lambda v: v.get_metadata()["logical_axes"], state,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable)))
    opt_state = jax.eval_shape(make_optimizer(cfg.optim, 10, logical).init, params)
    optax_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(opt_state))
    work = Workload.from_config(cfg)
    planned = state_bytes(ModelShape.from_config(cfg.model), Candidate(), work)[2]
    # Off by the step counters only (a few int32 scalars).
    assert planned == pytest.approx(optax_bytes, abs=64)


@pytest.mark.parametrize("name", optimizer_names())
def test_each_optimizer_refuses_the_moment_settings_it_has_no_use_for(name):
    for key, why in optimizer_facts(name).not_applicable:
        cfg = load_config(None, [f"optim.name={name}", f"optim.{key}=0.5"])
        with pytest.raises(ConfigError, match=rf"optim.{key}=0.5 does not apply to optim.name={name}"):
            hyperparameters(cfg.optim)
        assert why


# --- model families -------------------------------------------------------------------------------------------------


def _model(qkv_bias=False, qk_norm=False, moe=False, window=None) -> ModelConfig:
    return ModelConfig(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, vocab_size=256,
                       qkv_bias=qkv_bias, qk_norm=qk_norm, sliding_window=window,
                       moe=MoEConfig(every=1, num_experts=4, experts_per_token=2, router_aux_weight=0.02,
                                     router_z_weight=0.0) if moe else None)


ALWAYS = {"gemma3_text": {"norm_plus_one": True, "sandwich_norms": True, "scale_embeddings": True,
                           "mlp_activation": "gelu_tanh", "query_pre_attn_scalar": 24.0, "final_logit_softcap": 30.0},
          "deepseek_v3": {"num_kv_heads": 4, "norm_eps": 1e-6,
                          "mla": MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                                           q_lora_rank=24),
                          "moe": MoEConfig(first_k_dense=1, num_experts=4, experts_per_token=2, num_shared_experts=1,
                                           router_score="sigmoid", routed_scaling_factor=2.5, n_group=2, topk_group=1,
                                           bias_update_rate=0.0, seq_aux_weight=0.0001, router_aux_weight=0.0,
                                           router_z_weight=0.0)},
          "deepseek_v2": {"num_kv_heads": 4, "norm_eps": 1e-6,
                          "mla": MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
                          "moe": MoEConfig(first_k_dense=1, num_experts=4, experts_per_token=2, num_shared_experts=2,
                                           norm_topk_prob=False, routed_scaling_factor=16.0, n_group=2,
                                           topk_group=1, group_score="max", seq_aux_weight=0.003,
                                           router_aux_weight=0.0, router_z_weight=0.0)},
          "gpt_oss": {"attn_output_bias": True, "attention_sinks": True, "d_ff": 32,
                      "moe": MoEConfig(num_experts=4, experts_per_token=2, router_logit_bias=True,
                                       expert_bias=True, swiglu_limit=7.0, router_aux_weight=0.02,
                                       router_z_weight=0.0)}}
"""What a family's checkpoints always have besides qkv_bias, qk_norm and moe (a new family with more adds a row)."""


def _family_model(family) -> ModelConfig:
    return replace(_model(family.qkv_bias, family.qk_norm, family.moe), **ALWAYS.get(family.model_type, {}))


ARCHITECTURE = ("num_layers", "d_model", "num_heads", "num_kv_heads", "resolved_head_dim", "d_ff", "vocab_size",
                "rope_theta", "rope_scaling", "qkv_bias", "qk_norm", "sliding_window", "norm_eps", "tie_embeddings",
                "resolved_moe_d_ff", *VARIANTS)


@pytest.mark.parametrize("family", families(), ids=lambda f: f.model_type)
def test_each_family_maps_our_model_to_its_config_json_and_back(family):
    model = _family_model(family)
    config = hf_config(model, {"model_type": family.model_type}, dtype="float32")
    assert config["model_type"] == family.model_type and config["architectures"] == [family.architecture]
    back = model_from_record(model_section(config))
    assert {k: getattr(back, k) for k in ARCHITECTURE} == {k: getattr(model, k) for k in ARCHITECTURE}
    assert (back.moe is None) == (model.moe is None)
    if model.moe is not None:
        assert replace(back.moe, d_ff=None) == model.moe
    assert hf_config(back, config, dtype="float32") == config  # a fixed point


@pytest.mark.parametrize("family", families(), ids=lambda f: f.model_type)
def test_each_familys_tensor_names_cover_every_parameter_once(family):
    model = _family_model(family)
    shapes = {g.path: g.shape for g in ModelShape.from_config(model).params}
    plan = list(pieces(model, family))
    assert len({(p.hf_name, p.path) for p in plan}) == len(plan)
    for name in {p.hf_name for p in plan}:  # a name twice is one tensor fused from two parameters (gpt-oss)
        kinds = sorted(p.layout.kind for p in plan if p.hf_name == name)
        assert len(kinds) == 1 or kinds == ["evens", "odds"], (name, kinds)
    filled = {path: set() for path in shapes}
    for p in plan:
        slot = shapes[p.path][:len(p.index)]
        assert all(0 <= i < n for i, n in zip(p.index, slot, strict=True)), p
        assert p.layout.kind in ("same", "transpose", "heads_in", "heads_out", "heads", "evens", "odds"), p
        filled[p.path].add(p.index)
    for path, shape in shapes.items():
        lead = len(next(iter(filled[path]))) if filled[path] else 0
        assert len(filled[path]) == math.prod(shape[:lead]), path  # every layer (and expert) slot once


def test_export_picks_a_family_whose_switches_are_the_models():
    for qkv, qk, moe, window in itertools.product((False, True), (False, True), (False, True), (None, 64)):
        model = _model(qkv, qk, moe, window)
        try:
            family = infer_family(model)
        except ConfigError:
            continue  # a combination no family has, named in the message
        assert family.claims(model)
        assert (family.qkv_bias, family.qk_norm, family.moe) == (qkv, qk, moe), family.model_type

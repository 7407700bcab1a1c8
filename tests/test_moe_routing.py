"""DeepSeek-style routing: scaling, optional renormalisation, biased selection, group limits, sequence-wise loss.

The routing math is checked against a float64 numpy transcription of DeepSeek-V3's gate (transformers'
DeepseekV3TopkRouter / DeepseekV3MoE.route_tokens_to_experts): sigmoid scores, selection on scores + bias,
groups ranked by the sum of their two best biased scores, top-k among the kept groups, gates from the
unbiased scores, renormalised (norm_topk_prob) and times routed_scaling_factor; and of DeepSeek-V2's
(DeepseekV2TopkRouter's group_limited_greedy): softmax scores, groups ranked by their best score.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmd_train.ops.routing import route, sequence_aux_loss


def deepseek_gate(logits, bias, k, n_group, topk_group, norm, scaling, score="sigmoid", group_score="top2_sum"):
    """float64 numpy reference: logits [T, E] -> (indices [T, k] best first, gates [T, k])."""
    logits = np.asarray(logits, np.float64)
    if score == "sigmoid":
        scores = 1 / (1 + np.exp(-logits))
    else:
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    choice = scores + (0 if bias is None else np.asarray(bias, np.float64))
    t, e = choice.shape
    grouped = choice.reshape(t, n_group, e // n_group)
    best = np.sort(grouped, -1)[..., ::-1]
    rank = best[..., 0] if group_score == "max" else best[..., :2].sum(-1)  # [T, n_group]
    keep = np.argsort(-rank, -1, kind="stable")[:, :topk_group]
    mask = np.zeros((t, n_group), bool)
    np.put_along_axis(mask, keep, True, -1)
    masked = np.where(np.repeat(mask, e // n_group, -1), choice, -np.inf)
    idx = np.argsort(-masked, -1, kind="stable")[:, :k]
    gates = np.take_along_axis(scores, idx, -1)
    if norm:
        gates = gates / gates.sum(-1, keepdims=True)
    return idx, gates * scaling


CASES = {
    # name: (E, k, n_group, topk_group, norm, scaling, bias?, score, group_score)
    "deepseek_v3_like": (16, 4, 4, 2, True, 2.5, True, "sigmoid", "top2_sum"),
    "groups_no_bias": (16, 3, 8, 3, True, 1.0, False, "sigmoid", "top2_sum"),
    "bias_no_groups": (8, 2, 1, 1, True, 1.0, True, "sigmoid", "top2_sum"),
    "no_renorm_scaled": (8, 2, 1, 1, False, 16.0, False, "softmax", "top2_sum"),  # DeepSeek-V2-Lite: greedy
    "deepseek_v2_groups": (16, 4, 4, 2, False, 16.0, False, "softmax", "max"),  # DeepSeek-V2: group_limited_greedy
    "qwen3_renorm_softmax": (8, 2, 1, 1, True, 1.0, False, "softmax", "top2_sum"),
}


@pytest.mark.parametrize("case", CASES)
def test_route_matches_float64_deepseek_gate(case):
    e, k, n_group, topk_group, norm, scaling, biased, score, group_score = CASES[case]
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, e)).astype(np.float32)
    bias = rng.normal(scale=0.3, size=(e,)).astype(np.float32) if biased else None
    idx, gates, _ = route(jnp.asarray(logits), k, score, bias=None if bias is None else jnp.asarray(bias),
                          norm=norm, scaling=scaling, n_group=n_group, topk_group=topk_group, group_score=group_score)
    want_idx, want_gates = deepseek_gate(logits, bias, k, n_group, topk_group, norm, scaling, score, group_score)
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_allclose(np.asarray(gates), want_gates, rtol=2e-6, atol=1e-7)
    if topk_group < n_group:  # the two ways of ranking groups choose differently for some of these tokens
        other = "max" if group_score == "top2_sum" else "top2_sum"
        other_idx, _ = deepseek_gate(logits, bias, k, n_group, topk_group, norm, scaling, score, other)
        assert (np.sort(other_idx, -1) != np.sort(want_idx, -1)).any(axis=-1).sum() >= 2


def test_bias_steers_selection_not_gates():
    """A large bias on expert 0 makes every token choose it, and its gate is still its unbiased score."""
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(32, 8)), jnp.float32)
    bias = jnp.zeros(8).at[0].set(10.0)
    idx, gates, _ = route(logits, 2, "sigmoid", bias=bias, norm=False)
    assert (np.asarray(idx[:, 0]) == 0).all()
    np.testing.assert_allclose(np.asarray(gates[:, 0]), np.asarray(jax.nn.sigmoid(logits[:, 0])), rtol=1e-6)
    # No gradient reaches the bias: it is state, moved by its own rule.
    grad = jax.grad(lambda b: jnp.sum(route(logits, 2, "sigmoid", bias=b)[1]))(bias)
    assert not np.asarray(grad).any()


def test_no_token_spans_more_than_topk_group_groups():
    e, k, n_group, topk_group = 32, 6, 8, 2
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(4, 64, e)), jnp.float32)
    bias = jnp.asarray(np.random.default_rng(3).normal(scale=0.5, size=(e,)), jnp.float32)
    idx, _, _ = route(logits, k, "sigmoid", bias=bias, n_group=n_group, topk_group=topk_group)
    groups = np.asarray(idx) // (e // n_group)
    spans = np.array([len(set(row)) for row in groups.reshape(-1, k)])
    assert spans.max() <= topk_group
    assert spans.max() == topk_group  # the limit binds: without it tokens would span more groups
    # and each token's k experts are distinct
    assert all(len(set(row)) == k for row in np.asarray(idx).reshape(-1, k))


def test_sequence_aux_loss():
    """1 for sequences that spread choices and scores evenly; larger when a sequence piles onto a few experts."""
    e = 8
    length = 8
    idx = np.stack([np.arange(length) % e, (np.arange(length) + 4) % e], -1)  # each expert chosen twice
    uniform = jnp.full((1, length, e), 0.5)
    assert float(sequence_aux_loss(uniform, jnp.asarray(idx[None]))) == pytest.approx(1.0, abs=1e-6)
    skewed = jnp.asarray(np.where(np.arange(e) < 2, 0.9, 0.1)[None, None].repeat(length, 1), jnp.float32)
    piled = jnp.asarray(np.tile([0, 1], (length, 1))[None])
    assert float(sequence_aux_loss(skewed, piled)) > 2.0
    # per sequence: two sequences, one balanced, one piled, give their mean
    both = sequence_aux_loss(jnp.concatenate([uniform, skewed]), jnp.asarray(np.concatenate([idx[None], piled])))
    assert float(both) == pytest.approx((1.0 + float(sequence_aux_loss(skewed, piled))) / 2, rel=1e-6)


# --- the keys: validity --------------------------------------------------------------------------


BAD_ROUTING = {
    "groups-not-dividing": (["model.moe.n_group=3"], ["model.moe.n_group=3", "num_experts=8", "1, 2, 4, 8"]),
    "topk-group-above-groups": (["model.moe.n_group=2", "model.moe.topk_group=4"],
                                ["model.moe.topk_group=4", "model.moe.n_group=2", "1 to 2"]),
    "k-beyond-the-groups": (["model.moe.n_group=4", "model.moe.topk_group=1", "model.moe.experts_per_token=3"],
                            ["model.moe.experts_per_token=3", "model.moe.topk_group=1", "up to 2"]),
    "first-dense-all-layers": (["model.moe.first_k_dense=4"], ["model.moe.first_k_dense=4", "0 to 3"]),
    "every-after-first-dense": (["model.moe.first_k_dense=1"],  # moe-tiny: every 2nd of the 3 layers left
                                ["model.moe.every=2", "3 layers after model.moe.first_k_dense=1", "1, 3"]),
}


@pytest.mark.parametrize("case", BAD_ROUTING)
def test_bad_routing_keys_are_refused_naming_them(case):
    from spmd_train import load_config
    from spmd_train.config.checks import check_layout
    from spmd_train.errors import ConfigError
    from tests.runs import ROOT

    overrides, needles = BAD_ROUTING[case]
    cfg = load_config(ROOT / "configs" / "moe.yaml", overrides)
    with pytest.raises(ConfigError) as err:
        check_layout(cfg, {**cfg.mesh.sizes(), "data": 1}, "cpu")
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_bad_routing_keys_exit_2_on_the_command_line(tmp_path):
    from tests.runs import cli

    proc = cli("train", "configs/moe.yaml", f"run.dir={tmp_path / 'run'}", "model.moe.n_group=2",
               "model.moe.topk_group=3")
    assert proc.returncode == 2, proc.stderr
    assert "model.moe.topk_group=3" in proc.stderr and "Traceback" not in proc.stderr


# --- a model with every option on: the bias's rule, sharded = one device, metrics -----------------------

DEEPSEEK_LIKE = ["model.moe.every=1", "model.moe.first_k_dense=1",  # DeepSeek-V3's layout: dense layer(s) first
                 "model.moe.router_score=sigmoid", "model.moe.n_group=4", "model.moe.topk_group=2",
                 "model.moe.routed_scaling_factor=2.5", "model.moe.norm_topk_prob=true",
                 "model.moe.bias_update_rate=0.01", "model.moe.seq_aux_weight=0.001",
                 "model.moe.num_shared_experts=1", "model.moe.router_aux_weight=0.0",
                 "backends.capacity_factor=8.0", "train.global_batch_size=8", "train.seq_len=32"]
ONE_DEVICE = ["mesh.expert=1", "mesh.fsdp=1"]


def _engine(overrides, devices):
    from spmd_train import Engine, load_config
    from tests.runs import ROOT

    return Engine.build(load_config(ROOT / "configs" / "moe.yaml", overrides), list(devices))


def _bias(params):
    return np.asarray(params["blocks"]["mlp"]["router_bias"])  # [MoE layers, E]: every layer after the dense first


def test_bias_moves_by_the_sign_of_each_experts_load_error(devices):
    """Over 3 steps: bias_after = bias_before + rate * sign(mean load - load), the load being what the step's
    routing (with the bias before) chose; the optimizer leaves it alone (Adam, weight decay on). Two layers (a dense
    one, then an MoE one) keep the two compiles short."""
    from spmd_train.data import make_source

    engine = _engine([*DEEPSEEK_LIKE, *ONE_DEVICE, "optim.weight_decay=0.1", "model.num_layers=2"], devices[:1])
    state, data = engine.init_state(), make_source(engine.cfg)
    rate = engine.cfg.model.moe.bias_update_rate
    objective = jax.jit(engine.objective)
    assert not _bias(state.params).any()  # balancing starts from no bias
    for step in range(3):
        batch = data.batch(step, engine.batch_sharding)
        load = np.asarray(objective(state.params, batch)[1]["expert_counts"])  # [MoE layers, E]
        before = _bias(state.params)
        state, metrics = engine.train_step(state, batch)
        after = _bias(state.params)
        np.testing.assert_allclose(after - before, rate * np.sign(load.mean(-1, keepdims=True) - load), atol=1e-7)
        assert (load.sum(-1) == 8 * 32 * 2).all()  # every (token, choice) counted once
        assert float(metrics["router_bias.0"]) == pytest.approx(np.ptp(after[0]), abs=1e-7)
        assert "expert_counts" not in metrics and "seq_aux_loss" in metrics
    assert np.abs(_bias(state.params)).max() > 0


@pytest.mark.slow
def test_sharded_steps_with_every_routing_option_equal_one_device(devices):
    """expert 4 x fsdp 2 on 8 devices against one device, 3 steps: losses, metrics and parameters, biases
    bit for bit (they move by +-rate from counts that agree exactly)."""
    from spmd_train.data import make_source

    def run(overrides, devs):
        engine = _engine(overrides, devs)
        state, data = engine.init_state(), make_source(engine.cfg)
        history = []
        for step in range(3):
            state, metrics = engine.train_step(state, data.batch(step, engine.batch_sharding))
            history.append({k: float(v) for k, v in jax.device_get(metrics).items() if k != "histograms"})
        return history, jax.tree.map(np.asarray, jax.device_get(state.params))

    sharded, one = run(DEEPSEEK_LIKE, devices), run([*DEEPSEEK_LIKE, *ONE_DEVICE], devices[:1])
    for key in ("loss", "grad_norm", "seq_aux_loss", "z_loss", "expert_load.0", "expert_load.2", "router_bias.1"):
        np.testing.assert_allclose([h[key] for h in sharded[0]], [h[key] for h in one[0]], rtol=1e-5, err_msg=key)
    np.testing.assert_array_equal(_bias(sharded[1]), _bias(one[1]))
    assert np.abs(_bias(one[1])).max() > 0
    for a, b in zip(jax.tree.leaves(sharded[1]), jax.tree.leaves(one[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_pipelined_routing_options_and_sequence_loss_equal_one_device(devices):
    """Groups, scaling and the sequence-wise loss inside 1F1B stages (expert 2 x fsdp 2 x pipeline 2) against one
    device accumulating the same microbatches: the sequence loss enters the stages' objective."""
    from tests.runs import relative_error
    from tests.test_moe_model import _train
    from tests.test_pipeline_moe import BASE, MICROBATCHES, PIPELINED

    options = ["model.moe.router_score=sigmoid", "model.moe.n_group=4", "model.moe.topk_group=2",
               "model.moe.routed_scaling_factor=2.5", "model.moe.seq_aux_weight=0.5"]
    history, params, engine = _train([*BASE, *options, *PIPELINED, "parallel.pipeline_schedule=1f1b"], devices, 3)
    ref_history, ref_params, _ = _train([*BASE, *options, *ONE_DEVICE, f"train.grad_accum={MICROBATCHES}"],
                                        devices[:1], 3)
    for key in ("loss", "grad_norm", "seq_aux_loss", "expert_load.0"):
        np.testing.assert_allclose([h[key] for h in history], [h[key] for h in ref_history], rtol=1e-5, err_msg=key)
    assert relative_error(engine.model_params(params), ref_params) < 1e-5


def test_generation_with_dense_first_layers_and_biased_groups_equals_recomputation(devices):
    """The cached decoder runs the first_k_dense stack, then the MoE stack with its biases and groups, token for
    token as the full forward pass (fsdp 2 x tensor 4)."""
    from spmd_train.train.generation import generate
    from tests.test_generate import NEW, PROMPTS, _engine, _params, _recomputed

    options = ["model.moe.every=1", "model.moe.first_k_dense=1", "model.moe.router_score=sigmoid",
               "model.moe.n_group=4", "model.moe.topk_group=2", "model.moe.routed_scaling_factor=2.5",
               "model.moe.bias_update_rate=0.001", "mesh.fsdp=2", "mesh.tensor=4"]
    engine = _engine(devices, "moe-tiny", *options)
    params = _params(engine)  # the biases drawn too: generation must route with them
    assert np.abs(np.asarray(params["blocks"]["mlp"]["router_bias"])).max() > 0
    assert generate(engine, params, PROMPTS, max_new_tokens=NEW).tokens == _recomputed(engine, params, PROMPTS, NEW)


@pytest.mark.slow
def test_router_biases_under_an_interleaved_pipeline_equal_one_device(devices):
    """Interleaved 1F1B stores the layer stack out of model order: the stages' per-layer counts come back in
    storage order, as the bias rows are, and the biases after 3 steps equal one device's bit for bit."""
    from tests.runs import relative_error
    from tests.test_moe_model import _train
    from tests.test_pipeline_moe import BASE, MICROBATCHES, PIPELINED

    options = ["model.moe.router_score=sigmoid", "model.moe.bias_update_rate=0.01", "model.moe.router_aux_weight=0.0"]
    history, params, engine = _train([*BASE, *options, *PIPELINED, "parallel.pipeline_schedule=interleaved_1f1b",
                                      "parallel.virtual_stages=2"], devices, 3)
    ref_history, ref_params, _ = _train([*BASE, *options, *ONE_DEVICE, f"train.grad_accum={MICROBATCHES}"],
                                        devices[:1], 3)
    assert engine.layer_order is not None  # the stored order differs from the model's
    for key in ("loss", "grad_norm", "expert_load.0", "expert_load.3", "router_bias.0", "router_bias.3"):
        np.testing.assert_allclose([h[key] for h in history], [h[key] for h in ref_history], rtol=1e-5, err_msg=key)
    bias = lambda p: np.asarray(p["blocks"]["moe"]["mlp"]["router_bias"])
    np.testing.assert_array_equal(bias(engine.model_params(params)), bias(ref_params))
    assert np.abs(bias(ref_params)).max() > 0
    assert relative_error(engine.model_params(params), ref_params) < 1e-5


def test_mixtral_export_refuses_deepseek_routing_naming_the_keys():
    from spmd_train import load_config
    from spmd_train.config.hf_config import infer_family
    from spmd_train.errors import ConfigError

    plain = load_config(None, ["model.preset=moe-tiny", "model.moe.every=1"]).model
    assert infer_family(plain).model_type == "mixtral"
    for key, value in (("routed_scaling_factor", "2.5"), ("norm_topk_prob", "false"), ("bias_update_rate", "0.001"),
                       ("first_k_dense", "2")):
        model = load_config(None, ["model.preset=moe-tiny", "model.moe.every=1", f"model.moe.{key}={value}"]).model
        with pytest.raises(ConfigError, match=f"{key}="):
            infer_family(model)
    grouped = load_config(None, ["model.preset=moe-tiny", "model.moe.every=1", "model.moe.n_group=4",
                                 "model.moe.topk_group=2"]).model
    with pytest.raises(ConfigError, match="topk_group=2"):
        infer_family(grouped)


def test_a_resume_may_change_the_bias_rate_but_not_add_or_drop_the_biases():
    """DeepSeek-V3 stops moving the biases for its last tokens: rate 0.001 -> 0 continues the same run; null (no
    biases) is another model."""
    from dataclasses import asdict

    from spmd_train import load_config
    from spmd_train.train.checkpoint import model_differences

    def cfg(rate):
        return load_config(None, ["model.preset=moe-tiny", f"model.moe.bias_update_rate={rate}"])

    saved = {"config": {"model": asdict(cfg(0.001).model)}}
    assert model_differences(saved, cfg(0.0)) == [] and model_differences(saved, cfg(0.01)) == []
    assert cfg(0.0).model.moe.router_bias and not cfg(0.0).model.moe.moves_bias
    (diff,) = model_differences(saved, cfg("null"))
    assert diff.startswith("model.moe.bias_update_rate: checkpoint 0.001, this run None")

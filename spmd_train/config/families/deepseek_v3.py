"""DeepSeek-V3 (and checkpoints in its layout: Kimi K2, DeepSeek-R1): multi-head latent attention, dense first layers,
then sigmoid-routed experts with a selection bias, group-limited top-k, routed scaling and shared experts.

Its rotary dimensions are stored in interleaved pairs (config.json's rope_interleave, true by default); import
reorders them into rotate-half's order, export back (`hf.names.Layout.rope`). YaRN's mscale_all_dim also scales its
softmax (model.rope_scaling, `models.transformer.layer_scoring`). The multi-token prediction modules the published
checkpoints carry after the last layer (num_nextn_predict_layers) import as model.mtp (`models.mtp`; override
model.mtp=null to leave them unread) and export back, each beside a copy of the shared embedding and head.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from spmd_train.config.families.hf_family import LLAMA_TENSORS, Family, refuse_field, register_family
from spmd_train.config.model_schema import ModelConfig
from spmd_train.errors import ConfigError

LATENT_EPS = 1e-6
"""transformers' DeepSeek-V3 normalises the query and key/value latents with this epsilon whatever rms_norm_eps says;
our MLA's latent norms take model.norm_eps, so the two must agree."""

TENSORS = replace(
    LLAMA_TENSORS,
    layer=(("attn_norm.scale", "input_layernorm.weight", "same"),
           ("mlp_norm.scale", "post_attention_layernorm.weight", "same"),
           ("attn.wq", "self_attn.q_proj.weight", "heads_in+rope"),
           ("attn.wq_a", "self_attn.q_a_proj.weight", "transpose"),
           ("attn.q_norm.scale", "self_attn.q_a_layernorm.weight", "same"),
           ("attn.wq_b", "self_attn.q_b_proj.weight", "heads_in+rope"),
           ("attn.wkv_a", "self_attn.kv_a_proj_with_mqa.weight", "transpose+rope"),
           ("attn.kv_norm.scale", "self_attn.kv_a_layernorm.weight", "same"),
           ("attn.wkv_b", "self_attn.kv_b_proj.weight", "heads_in"),
           ("attn.wo", "self_attn.o_proj.weight", "heads_out")),
    router="mlp.gate.weight", router_bias="mlp.gate.e_score_correction_bias", expert="mlp.experts.{e}.{w}.weight",
    expert_weights=(("mlp.w_gate", "gate_proj"), ("mlp.w_up", "up_proj"), ("mlp.w_down", "down_proj")),
    shared=(("mlp.shared_gate", "mlp.shared_experts.gate_proj.weight", "transpose"),
            ("mlp.shared_up", "mlp.shared_experts.up_proj.weight", "transpose"),
            ("mlp.shared_down", "mlp.shared_experts.down_proj.weight", "transpose")),
    mtp=(("embed_norm.scale", "enorm.weight", "same"), ("hidden_norm.scale", "hnorm.weight", "same"),
         ("eh_proj", "eh_proj.weight", "transpose"), ("head_norm.scale", "shared_head.norm.weight", "same")),
    mtp_copies=(("embedding", "embed_tokens.weight", "same"), ("lm_head", "shared_head.head.weight", "transpose")))
"""Llama's norms and dense MLP names; MLA's projections; the router (`gate`) with its selection bias, each expert's
SwiGLU and the shared experts' under `mlp`; the multi-token prediction modules' own tensors and their copies of the
shared tables."""

MTP_LOSS_WEIGHT = 0.1
"""model.mtp.loss_weight of an imported checkpoint: DeepSeek-V3's for the last 4.8T tokens of its pretraining."""


def _claims(model: ModelConfig) -> bool:
    # Softmax-routed MLA models are DeepSeek-V2's to hold or refuse.
    return model.mla is not None and model.moe is not None and model.moe.router_score == "sigmoid"


def _refusal(model: ModelConfig) -> str | None:
    moe = model.moe
    unlike = {"every": (moe.every, 1),
              "router_logit_bias": (moe.router_logit_bias, False), "expert_bias": (moe.expert_bias, False),
              "swiglu_limit": (moe.swiglu_limit, None)}
    if moe.topk_group < moe.n_group:
        unlike["group_score"] = (moe.group_score, "top2_sum")
    wrong = [f"model.moe.{k}={v}" for k, (v, want) in unlike.items() if v != want]
    if moe.bias_update_rate is None:
        wrong.append("model.moe.bias_update_rate=null")
    wrong += mla_refusals(model)
    if wrong:
        return (f"DeepSeek-V3 routes every layer after the dense first ones by sigmoid scores with a selection bias "
                f"(bias_update_rate set; 0 keeps it), groups ranked by their two best scores, through plain SwiGLU "
                f"experts, and its MLA has no sinks, norms on heads, biases or window, and norm epsilon {LATENT_EPS} "
                f"(this model: {', '.join(wrong)})")
    return None


def _read(hf: Mapping[str, Any], model: dict[str, Any]) -> None:
    refuse_field(hf, "rope_interleave", True, "import reorders interleaved rotary dimensions, DeepSeek's layout")
    refuse_field(hf, "scoring_func", "sigmoid", "DeepSeek-V3 routes by sigmoid scores")
    refuse_field(hf, "topk_method", "noaux_tc", "DeepSeek-V3 selects with a bias, group-limited")
    refuse_field(hf, "moe_layer_freq", 1, "every layer after the dense first ones is an MoE layer")
    read_mla(hf, model, "deepseek_v3")
    experts = hf.get("n_routed_experts", hf.get("num_local_experts"))
    # The selection bias is kept as imported (rate 0) and no balance loss but DeepSeek-V3's sequence-wise one is on:
    # a fine-tune sets model.moe.bias_update_rate (DeepSeek-V3 pretrained at 0.001) and the losses it wants.
    model["moe"] = {"every": 1, "first_k_dense": int(hf.get("first_k_dense_replace", 0)), "num_experts": int(experts),
                    "experts_per_token": int(hf["num_experts_per_tok"]), "d_ff": int(hf["moe_intermediate_size"]),
                    "num_shared_experts": int(hf.get("n_shared_experts") or 0), "router_score": "sigmoid",
                    "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
                    "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
                    "n_group": int(hf.get("n_group") or 1), "topk_group": int(hf.get("topk_group") or 1),
                    "bias_update_rate": 0.0, "seq_aux_weight": 0.0001, "router_aux_weight": 0.0,
                    "router_z_weight": 0.0}
    depth = int(hf.get("num_nextn_predict_layers") or 0)
    if depth:
        model["mtp"] = {"depth": depth, "loss_weight": MTP_LOSS_WEIGHT}


def read_mla(hf: Mapping[str, Any], model: dict[str, Any], model_type: str) -> None:
    """model.mla from a DeepSeek config.json (V2 and V3 share the fields), refusing a checkpoint without MoE layers."""
    refuse_field(hf, "rms_norm_eps", LATENT_EPS, f"its latent norms' epsilon is fixed at {LATENT_EPS}, and ours is "
                 "model.norm_eps for every norm")
    if int(hf.get("first_k_dense_replace", 0)) >= int(hf["num_hidden_layers"]):
        raise ConfigError(f"config.json: first_k_dense_replace={hf['first_k_dense_replace']} leaves no MoE layer in "
                          f"num_hidden_layers={hf['num_hidden_layers']}; a dense model is not a {model_type} "
                          "checkpoint")
    model.pop("head_dim", None)  # MLA's widths are its own
    model["mla"] = {"kv_lora_rank": int(hf["kv_lora_rank"]), "q_lora_rank": _rank(hf.get("q_lora_rank")),
                    "qk_nope_head_dim": int(hf["qk_nope_head_dim"]), "qk_rope_head_dim": int(hf["qk_rope_head_dim"]),
                    "v_head_dim": int(hf["v_head_dim"])}


def write_mla(model: ModelConfig, out: dict[str, Any]) -> None:
    """config.json's MLA fields, experts, shared experts, dense first layers and routed scaling (V2's and V3's)."""
    mla, moe = model.mla, model.moe
    routed = "n_routed_experts"
    experts = "num_local_experts" if "num_local_experts" in out and routed not in out else routed
    out.update({"kv_lora_rank": mla.kv_lora_rank, "q_lora_rank": mla.q_lora_rank,
                "qk_nope_head_dim": mla.qk_nope_head_dim, "qk_rope_head_dim": mla.qk_rope_head_dim,
                "v_head_dim": mla.v_head_dim, "head_dim": mla.qk_rope_head_dim,
                experts: moe.num_experts, "num_experts_per_tok": moe.experts_per_token,
                "moe_intermediate_size": model.resolved_moe_d_ff, "n_shared_experts": moe.num_shared_experts,
                "first_k_dense_replace": moe.first_k_dense, "norm_topk_prob": moe.norm_topk_prob,
                "routed_scaling_factor": moe.routed_scaling_factor, "attention_bias": False})


def mla_refusals(model: ModelConfig) -> list[str]:
    """What DeepSeek's MLA layers (V2 and V3) cannot hold: sinks, Q/K norms, biases, a window, another epsilon."""
    wrong = []
    if model.attention_sinks or model.qk_norm or model.qkv_bias or model.attn_output_bias:
        wrong.append("sinks, Q/K norms or attention biases")
    if model.sliding_window is not None:
        wrong.append(f"model.sliding_window={model.sliding_window}")
    if model.norm_eps != LATENT_EPS:
        wrong.append(f"model.norm_eps={model.norm_eps} (its latent norms' epsilon is fixed at {LATENT_EPS})")
    return wrong


def _unread(hf: Mapping[str, Any], model: ModelConfig) -> tuple[str, ...]:
    # The MTP modules are stored as layers num_hidden_layers .. + num_nextn_predict_layers - 1; the model reads the
    # first model.mtp.depth of them.
    first, read = int(hf["num_hidden_layers"]), 0 if model.mtp is None else model.mtp.depth
    return tuple(f"model.layers.{i}." for i in range(first + read,
                                                     first + int(hf.get("num_nextn_predict_layers") or 0)))


def _rank(value: Any) -> int | None:
    return int(value) if value else None


def _write(model: ModelConfig, out: dict[str, Any]) -> None:
    write_mla(model, out)
    moe = model.moe
    out.update({"rope_interleave": True, "n_group": moe.n_group, "topk_group": moe.topk_group,
                "num_nextn_predict_layers": 0 if model.mtp is None else model.mtp.depth})


DEEPSEEK_V3 = register_family(Family("deepseek_v3", "DeepseekV3ForCausalLM", "DeepSeek-V3", _claims, moe=True,
                                     read=_read, write=_write, refusal=_refusal, tensors=TENSORS, unread=_unread,
                                     holds=frozenset({"mla"})))

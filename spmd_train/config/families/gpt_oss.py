"""gpt-oss: attention with Q/K/V and output biases and a learned sink per head, alternating sliding and full layers,
YaRN, and every MLP a top-k mixture of experts behind a biased linear router, each expert a clamped SwiGLU with
biases whose gate and up projections are stored fused, column by column (`GptOssForCausalLM`, model_type gpt_oss).

The experts are stored as one tensor per layer: gate_up_proj [experts, d, 2 x width] (gate in the even columns, up in
the odd ones) and down_proj [experts, width, d], both [in, out] as they are used. The published checkpoints keep them
MXFP4-quantized (`*_blocks`, `*_scales`), which `hf.files` reads dequantized; export writes them unquantized.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from spmd_train.config.families.hf_family import (
    LLAMA_TENSORS,
    Family,
    hf_layer_types,
    refuse_field,
    register_family,
)
from spmd_train.config.model_schema import ModelConfig

ALPHA = 1.702
"""The clamped SwiGLU's sigmoid slope (config.json's swiglu_alpha), fixed in `ops.experts.activate`."""

TENSORS = replace(
    LLAMA_TENSORS,
    layer=(*LLAMA_TENSORS.layer,
           ("attn.bo", "self_attn.o_proj.bias", "same"),
           ("attn.sinks", "self_attn.sinks", "same"),
           ("mlp.router", "mlp.router.weight", "transpose"),
           ("mlp.router_logit_bias", "mlp.router.bias", "same"),
           ("mlp.w_gate", "mlp.experts.gate_up_proj", "evens"),
           ("mlp.w_up", "mlp.experts.gate_up_proj", "odds"),
           ("mlp.b_gate", "mlp.experts.gate_up_proj_bias", "evens"),
           ("mlp.b_up", "mlp.experts.gate_up_proj_bias", "odds"),
           ("mlp.w_down", "mlp.experts.down_proj", "same"),
           ("mlp.b_down", "mlp.experts.down_proj_bias", "same")))
"""Llama's norms and attention, its output bias and sinks, the router and every expert of a layer in one tensor."""
SWITCHES = ("qkv_bias", "attn_output_bias", "attention_sinks")
MOE_SWITCHES = ("router_logit_bias", "expert_bias")


def _claims(model: ModelConfig) -> bool:
    return model.moe is not None and model.attention_sinks


def _refusal(model: ModelConfig) -> str | None:
    moe = model.moe
    wrong = [f"model.{s}=false" for s in SWITCHES if not getattr(model, s)]
    wrong += [f"model.moe.{s}=false" for s in MOE_SWITCHES if not getattr(moe, s)]
    plain = {"every": 1, "first_k_dense": 0, "num_shared_experts": 0, "router_score": "softmax",
             "norm_topk_prob": True, "bias_update_rate": None, "routed_scaling_factor": 1.0}
    wrong += [f"model.moe.{k}={getattr(moe, k)}" for k, v in plain.items() if getattr(moe, k) != v]
    wrong += [f"model.moe.topk_group={moe.topk_group}"] if moe.topk_group < moe.n_group else []
    wrong += ["model.moe.swiglu_limit=null"] if moe.swiglu_limit is None else []
    wrong += ["model.qk_norm=true"] if model.qk_norm else []
    if wrong:
        return ("gpt-oss has Q/K/V and output biases, sinks, a biased router taking a softmax over its top k in every "
                f"layer, and biased clamped-SwiGLU experts, nothing else (this model: {', '.join(wrong)})")
    return None


def _read(hf: Mapping[str, Any], model: dict[str, Any]) -> None:
    refuse_field(hf, "attention_bias", True, "gpt-oss's attention has biases")
    refuse_field(hf, "swiglu_alpha", ALPHA, "the clamped SwiGLU's slope is gpt-oss's")
    width = int(hf["intermediate_size"])
    model.update({"attn_output_bias": True, "attention_sinks": True})
    model["moe"] = {"every": 1, "num_experts": int(hf["num_local_experts"]),
                    "experts_per_token": int(hf["num_experts_per_tok"]), "d_ff": width, "router_score": "softmax",
                    "norm_topk_prob": True, "router_logit_bias": True, "expert_bias": True,
                    "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
                    "router_aux_weight": float(hf.get("router_aux_loss_coef", 0.001)), "router_z_weight": 0.0}


def _write(model: ModelConfig, out: dict[str, Any]) -> None:
    moe = model.moe
    if "rope_parameters" not in out:
        # transformers' GptOssConfig reads an absent rope_parameters as YaRN x32 (the published setting) whatever the
        # legacy rope_theta and rope_scaling say, so its RoPE is always written in the current layout.
        scaling = out.pop("rope_scaling", None) or {"rope_type": "default"}
        out["rope_parameters"] = {**scaling, "rope_theta": out.pop("rope_theta")}
        out["dtype"] = out.pop("torch_dtype")
    out.update({"sliding_window": model.sliding_window,
                "layer_types": hf_layer_types(model),
                "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.experts_per_token,
                "intermediate_size": model.resolved_moe_d_ff, "swiglu_limit": moe.swiglu_limit,
                "swiglu_alpha": ALPHA, "router_aux_loss_coef": moe.router_aux_weight, "attention_bias": True})


GPT_OSS = register_family(Family("gpt_oss", "GptOssForCausalLM", "gpt-oss", _claims, qkv_bias=True, moe=True,
                                 layer_types=True, read=_read, write=_write, refusal=_refusal,
                                 tensors=replace(TENSORS, router=""),
                                 holds=frozenset({"attention_sinks", "attn_output_bias"})))

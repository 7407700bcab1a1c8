"""Qwen3-MoE: Qwen3's attention (Q/K norms) with every layer's MLP a top-k mixture of SwiGLU experts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from spmd_train.config.families.hf_family import (
    LLAMA_TENSORS,
    Family,
    qwen_window,
    refuse_field,
    register_family,
    unplain_moe,
)
from spmd_train.config.model_schema import ModelConfig


def _claims(model: ModelConfig) -> bool:
    return model.moe is not None and model.qk_norm


def _refusal(model: ModelConfig) -> str | None:
    moe = model.moe
    if moe.every != 1 or moe.num_shared_experts or moe.router_score != "softmax" or model.qkv_bias:
        return ("Qwen3-MoE has an MoE layer in every layer, no shared experts, softmax routing and no Q/K/V biases "
                f"(this one: model.moe.every={moe.every}, num_shared_experts={moe.num_shared_experts}, "
                f"router_score={moe.router_score}, qkv_bias={model.qkv_bias})")
    return unplain_moe(moe, "Qwen3-MoE")


def _read(hf: Mapping[str, Any], model: dict[str, Any]) -> None:
    refuse_field(hf, "decoder_sparse_step", 1, "every layer is an MoE layer")
    refuse_field(hf, "mlp_only_layers", [], "every layer is an MoE layer")
    # The published checkpoints renormalise the top-k gates; transformers' default (an absent field) does not.
    experts = hf.get("num_experts", hf.get("num_local_experts"))  # the published name; transformers 5 writes the other
    model["moe"] = {"every": 1, "num_experts": int(experts),
                    "experts_per_token": int(hf["num_experts_per_tok"]), "d_ff": int(hf["moe_intermediate_size"]),
                    "router_score": "softmax", "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
                    "router_aux_weight": float(hf.get("router_aux_loss_coef", 0.001)), "router_z_weight": 0.0}


def _write(model: ModelConfig, out: dict[str, Any]) -> None:
    moe = model.moe
    experts = "num_local_experts" if "num_local_experts" in out and "num_experts" not in out else "num_experts"
    out.update({experts: moe.num_experts, "num_experts_per_tok": moe.experts_per_token,
                "moe_intermediate_size": model.resolved_moe_d_ff, "norm_topk_prob": moe.norm_topk_prob,
                "router_aux_loss_coef": moe.router_aux_weight, "decoder_sparse_step": 1, "mlp_only_layers": []})
    # Every layer slides when use_sliding_window is set (its config.json has no per-layer kinds).
    out["use_sliding_window"] = model.sliding_window is not None
    if model.sliding_window is not None:
        out["sliding_window"] = model.sliding_window
    out["attention_bias"] = False  # its config has the field


# The router is `mlp.gate`; each expert's SwiGLU keeps Llama's gate/up/down names.
TENSORS = replace(LLAMA_TENSORS, router="mlp.gate.weight", expert="mlp.experts.{e}.{w}.weight",
                  expert_weights=(("mlp.w_gate", "gate_proj"), ("mlp.w_up", "up_proj"), ("mlp.w_down", "down_proj")))
QWEN3_MOE = register_family(Family("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE", _claims, qk_norm=True, moe=True,
                                   window=qwen_window, read=_read, write=_write, refusal=_refusal,
                                   tensors=TENSORS))

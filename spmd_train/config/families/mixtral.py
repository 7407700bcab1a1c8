"""Mixtral: every layer's MLP 8 SwiGLU experts, top-2, softmax gates renormalised (model.moe, no router z-loss)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from spmd_train.config.families.hf_family import (
    LLAMA_TENSORS,
    Family,
    refuse_field,
    register_family,
    unplain_moe,
    write_plain_window,
)
from spmd_train.config.model_schema import ModelConfig


def _claims(model: ModelConfig) -> bool:
    return model.moe is not None


def _refusal(model: ModelConfig) -> str | None:
    moe = model.moe
    if moe.every != 1 or moe.num_shared_experts or moe.router_score != "softmax":
        return ("a mixture-of-experts model exports as Mixtral, which has an MoE layer in every layer, no shared "
                f"experts and softmax routing (this one: model.moe.every={moe.every}, "
                f"num_shared_experts={moe.num_shared_experts}, router_score={moe.router_score})")
    # DeepSeek-V3's routing and gpt-oss's experts: Mixtral's router always renormalises.
    unlike = unplain_moe(moe, "Mixtral", norm_topk_prob=True)
    if unlike:
        return unlike
    if model.qkv_bias or model.qk_norm:
        return ("Mixtral has neither Q/K/V biases nor Q/K norms (model.qkv_bias and model.qk_norm must be false to "
                "export a mixture-of-experts model)")
    return None


def _read(hf: Mapping[str, Any], model: dict[str, Any]) -> None:
    refuse_field(hf, "router_jitter_noise", 0.0, "routing is deterministic")
    # Mixtral's recipe has the load-balancing loss at router_aux_loss_coef and no router z-loss.
    model["moe"] = {"every": 1, "num_experts": int(hf["num_local_experts"]),
                    "experts_per_token": int(hf["num_experts_per_tok"]), "d_ff": int(hf["intermediate_size"]),
                    "router_score": "softmax", "router_aux_weight": float(hf.get("router_aux_loss_coef", 0.02)),
                    "router_z_weight": 0.0}


def _write(model: ModelConfig, out: dict[str, Any]) -> None:
    out.update({"num_local_experts": model.moe.num_experts, "num_experts_per_tok": model.moe.experts_per_token,
                "intermediate_size": model.resolved_moe_d_ff, "router_aux_loss_coef": model.moe.router_aux_weight})
    write_plain_window(model, out)


# Its experts' weights: w1 is the gate, w3 the up projection, w2 the down projection.
TENSORS = replace(LLAMA_TENSORS, router="block_sparse_moe.gate.weight",
                  expert="block_sparse_moe.experts.{e}.{w}.weight",
                  expert_weights=(("mlp.w_gate", "w1"), ("mlp.w_up", "w3"), ("mlp.w_down", "w2")))
MIXTRAL = register_family(Family("mixtral", "MixtralForCausalLM", "Mixtral", _claims, moe=True, read=_read,
                                 write=_write, refusal=_refusal, tensors=TENSORS))

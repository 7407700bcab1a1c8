"""DeepSeek-V2 (and V2-Lite, V2.5, Coder-V2): multi-head latent attention, dense first layers, then softmax-routed
experts without renormalisation, scaled, with shared experts, group-limited or not.

Its layout is DeepSeek-V3's without the selection bias and the multi-token prediction modules: the same tensor names,
the rotary dimensions stored in interleaved pairs (always: its config.json has no rope_interleave), YaRN's
mscale_all_dim scaling the softmax too. Routing differs: softmax scores, top-k greedy over every expert
(`topk_method: greedy`, V2-Lite) or from the `topk_group` groups with the best single score
(`group_limited_greedy`, V2: `model.moe.group_score: max`), the gates the chosen scores times routed_scaling_factor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from spmd_train.config.families.deepseek_v3 import TENSORS as V3_TENSORS
from spmd_train.config.families.deepseek_v3 import mla_refusals, read_mla, write_mla
from spmd_train.config.families.hf_family import Family, refuse_field, register_family
from spmd_train.config.model_schema import ModelConfig
from spmd_train.errors import ConfigError

TENSORS = replace(V3_TENSORS, router_bias="", mtp=(), mtp_copies=())
"""DeepSeek-V3's names (MLA, router `gate`, experts, shared experts) without its selection bias and MTP modules."""

TOPK_METHODS = {"greedy": "top-k over every expert", "group_limited_greedy": "top-k from the topk_group groups "
                "holding the best single scores"}
"""config.json's topk_method values and what each selects."""

AUX_LOSS_ALPHA = 0.001
"""aux_loss_alpha when config.json lacks it (DeepSeek-V2-Lite's; V2 trained with 0.003)."""


def _claims(model: ModelConfig) -> bool:
    # Sigmoid-routed MLA models are DeepSeek-V3's to hold or refuse.
    return model.mla is not None and model.moe is not None and model.moe.router_score == "softmax"


def _refusal(model: ModelConfig) -> str | None:
    moe = model.moe
    unlike = {"every": (moe.every, 1), "norm_topk_prob": (moe.norm_topk_prob, False),
              "bias_update_rate": (moe.bias_update_rate, None),
              "router_logit_bias": (moe.router_logit_bias, False), "expert_bias": (moe.expert_bias, False),
              "swiglu_limit": (moe.swiglu_limit, None)}
    if moe.topk_group < moe.n_group:
        unlike["group_score"] = (moe.group_score, "max")
    wrong = [f"model.moe.{k}={'null' if v is None else v}" for k, (v, want) in unlike.items() if v != want]
    wrong += mla_refusals(model)
    if wrong:
        return ("DeepSeek-V2 routes every layer after the dense first ones by softmax scores, not renormalised, "
                "without a selection bias, groups ranked by their best score, through plain SwiGLU experts, and its "
                f"MLA has no sinks, norms on heads, biases or window (this model: {', '.join(wrong)})")
    return None


def _read(hf: Mapping[str, Any], model: dict[str, Any]) -> None:
    refuse_field(hf, "scoring_func", "softmax", "DeepSeek-V2 routes by softmax scores")
    refuse_field(hf, "moe_layer_freq", 1, "every layer after the dense first ones is an MoE layer")
    # transformers' DeepseekV2 never renormalises the gates; a checkpoint asking for it was trained by other code.
    refuse_field(hf, "norm_topk_prob", False, "transformers' DeepSeek-V2 does not renormalise the top-k gates")
    method = hf.get("topk_method", "greedy")
    if method not in TOPK_METHODS:
        raise ConfigError(f"config.json: topk_method={method!r} is not supported (valid: "
                          f"{', '.join(f'{k} ({v})' for k, v in TOPK_METHODS.items())})")
    read_mla(hf, model, "deepseek_v2")
    limited = method == "group_limited_greedy"
    groups = (int(hf["n_group"]), int(hf["topk_group"])) if limited else (1, 1)
    experts = hf.get("n_routed_experts", hf.get("num_local_experts"))
    # The balance loss it trained with: per sequence (seq_aux, on by default) or over the batch, whose alpha is
    # over assignments (k per token) where ours is over tokens.
    alpha, k = float(hf.get("aux_loss_alpha", AUX_LOSS_ALPHA)), int(hf["num_experts_per_tok"])
    per_sequence = bool(hf.get("seq_aux", True))
    model["moe"] = {"every": 1, "first_k_dense": int(hf.get("first_k_dense_replace", 0)), "num_experts": int(experts),
                    "experts_per_token": k, "d_ff": int(hf["moe_intermediate_size"]),
                    "num_shared_experts": int(hf.get("n_shared_experts") or 0), "router_score": "softmax",
                    "norm_topk_prob": False, "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
                    "n_group": groups[0], "topk_group": groups[1], "group_score": "max",
                    "seq_aux_weight": alpha if per_sequence else 0.0,
                    "router_aux_weight": 0.0 if per_sequence else alpha / k, "router_z_weight": 0.0}


def _write(model: ModelConfig, out: dict[str, Any]) -> None:
    write_mla(model, out)
    moe = model.moe
    limited = moe.topk_group < moe.n_group
    per_sequence = moe.seq_aux_weight > 0 or moe.router_aux_weight == 0
    alpha = moe.seq_aux_weight if per_sequence else moe.router_aux_weight * moe.experts_per_token
    out.update({"topk_method": "group_limited_greedy" if limited else "greedy",
                "n_group": moe.n_group if limited else None, "topk_group": moe.topk_group if limited else None})
    # DeepSeek's own loss fields, which transformers neither reads nor writes: only when not what import assumes.
    for key, value, default in (("seq_aux", per_sequence, True), ("aux_loss_alpha", alpha, AUX_LOSS_ALPHA)):
        if value != default or key in out:
            out[key] = value


DEEPSEEK_V2 = register_family(Family("deepseek_v2", "DeepseekV2ForCausalLM", "DeepSeek-V2", _claims, moe=True,
                                     read=_read, write=_write, refusal=_refusal, tensors=TENSORS,
                                     holds=frozenset({"mla"})))

"""Gemma 3 (text): sandwich norms, (1 + w) RMSNorms, scaled embeddings, GeGLU, Q/K norms, a query scale of its own,
5:1 local/global layers with a local RoPE base, an optional output soft-cap (`Gemma3ForCausalLM`, model_type
gemma3_text).

config.json's attn_logit_softcapping is refused when set: transformers' Gemma 3 reads it and never applies it
(5.24), so a checkpoint that sets it means whatever the code that trained it did. The multimodal checkpoints
(model_type gemma3) hold this model under `language_model`; they are not read here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from spmd_train.config.families.hf_family import (
    Family,
    TensorNames,
    hf_layer_types,
    refuse_field,
    register_family,
)
from spmd_train.config.model_schema import ModelConfig
from spmd_train.errors import ConfigError

ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "silu": "silu"}
"""config.json's hidden_activation -> model.mlp_activation (transformers' names)."""
GEMMA_SWITCHES = ("qk_norm", "norm_plus_one", "sandwich_norms", "scale_embeddings")
"""What every Gemma 3 layer has, so a model without one of them is not a Gemma 3."""
DEFAULT_QUERY_SCALAR = 256
"""transformers' default query_pre_attn_scalar, read when config.json leaves it out."""

GEMMA3_TENSORS = TensorNames(layer=(("attn_norm.scale", "input_layernorm.weight", "same"),
                                    ("attn_post_norm.scale", "post_attention_layernorm.weight", "same"),
                                    ("mlp_norm.scale", "pre_feedforward_layernorm.weight", "same"),
                                    ("mlp_post_norm.scale", "post_feedforward_layernorm.weight", "same"),
                                    ("attn.wq", "self_attn.q_proj.weight", "heads_in"),
                                    ("attn.wk", "self_attn.k_proj.weight", "heads_in"),
                                    ("attn.wv", "self_attn.v_proj.weight", "heads_in"),
                                    ("attn.wo", "self_attn.o_proj.weight", "heads_out")))
"""Llama's names, except that `post_attention_layernorm` is the attention output's norm (Llama's MLP input norm)."""


def _claims(model: ModelConfig) -> bool:
    return model.moe is None and any(getattr(model, s) for s in GEMMA_SWITCHES[1:])


def _refusal(model: ModelConfig) -> str | None:
    missing = [f"model.{s}=false" for s in GEMMA_SWITCHES if not getattr(model, s)]
    if missing:
        return (f"Gemma 3 has Q/K norms, (1 + w) norms, sandwich norms and scaled embeddings together (this model: "
                f"{', '.join(missing)}; valid: all four true)")
    scalar = model.query_pre_attn_scalar
    if scalar is not None and not float(scalar).is_integer():
        return (f"Gemma 3's config.json holds query_pre_attn_scalar as an integer (this model: "
                f"model.query_pre_attn_scalar={scalar}; valid: a whole number, or null for head_dim)")
    if model.qkv_bias or model.attn_output_bias:
        return ("Gemma 3's attention_bias puts biases on all four projections together (this model: model.qkv_bias="
                f"{model.qkv_bias}, attn_output_bias={model.attn_output_bias}; valid: both false)")
    if model.rope_scaling is not None and model.rope_local_theta is None and "sliding" in model.attention_kinds:
        return (f"Gemma 3's sliding layers take no rope_scaling, and this model scales every layer's RoPE "
                f"(model.rope_scaling.type={model.rope_scaling.type} without model.rope_local_theta; valid: set "
                "model.rope_local_theta, the sliding layers' unscaled base)")
    return None


def _read(hf: Mapping[str, Any], model: dict[str, Any]) -> None:
    refuse_field(hf, "use_bidirectional_attention", False, "attention is causal")
    refuse_field(hf, "attn_logit_softcapping", None, "transformers' Gemma 3 does not apply it, so its meaning is "
                 "unknown")
    activation = hf.get("hidden_activation", "gelu_pytorch_tanh")
    if activation not in ACTIVATIONS:
        raise ConfigError(f"config.json: hidden_activation={activation!r} is not supported (valid: "
                          f"{', '.join(ACTIVATIONS)})")
    model.update({"norm_plus_one": True, "sandwich_norms": True, "scale_embeddings": True,
                  "mlp_activation": ACTIVATIONS[activation],
                  "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar") or DEFAULT_QUERY_SCALAR),
                  "final_logit_softcap": _cap(hf.get("final_logit_softcapping"))})


def _cap(value: Any) -> float | None:
    return float(value) if value else None


def _write(model: ModelConfig, out: dict[str, Any]) -> None:
    out.pop("hidden_act", None)
    local = model.rope_local_theta if model.rope_local_theta is not None else model.rope_theta
    out.update({"hidden_activation": {v: k for k, v in ACTIVATIONS.items()}[model.mlp_activation],
                "query_pre_attn_scalar": int(model.query_pre_attn_scalar or model.resolved_head_dim),
                "attn_logit_softcapping": None,
                "final_logit_softcapping": model.final_logit_softcap, "attention_bias": False,
                "sliding_window": model.sliding_window,
                "layer_types": hf_layer_types(model)})
    out.pop("sliding_window_pattern", None)  # layer_types alone says which layers slide
    if "rope_parameters" in out:  # the current layout: RoPE per layer type, the sliding layers' unscaled
        out["rope_parameters"] = {"full_attention": out["rope_parameters"],
                                  "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    else:
        out["rope_local_base_freq"] = local


GEMMA3 = register_family(Family(
    "gemma3_text", "Gemma3ForCausalLM", "Gemma 3", _claims, qk_norm=True, layer_types=True, read=_read, write=_write,
    refusal=_refusal, tensors=GEMMA3_TENSORS,
    holds=frozenset({"norm_plus_one", "sandwich_norms", "scale_embeddings", "mlp_activation", "query_pre_attn_scalar",
                     "final_logit_softcap", "rope_local_theta"})))

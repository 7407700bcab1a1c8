"""Hugging Face `config.json` <-> our `model` section, for the Llama, Mistral, Qwen2, Qwen3 and Mixtral families.

Both layouts of `config.json` are read: the one most published checkpoints use (top-level `rope_theta`,
`rope_scaling`, `torch_dtype`) and the one current `transformers` writes (`rope_parameters`, `dtype`).
Fields that change the computation and that the model does not implement are refused by name; the rest
(token ids, `max_position_embeddings`, `use_cache`, ...) do not affect the weights' meaning and are kept
only for export. No jax here: the config loader reads this before jax starts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from spmd_train.config.model_schema import ModelConfig
from spmd_train.errors import ConfigError

FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM"}
"""model_type -> the `transformers` class its checkpoints load into."""
HF_PREFIX = "hf:"
"""checkpoint.load_from=hf:DIR names a Hugging Face checkpoint directory."""
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "bfloat16"}
"""The checkpoint's dtype -> our compute dtype (float16 checkpoints compute in bfloat16: same exponent range
as training needs, no loss scaling). Parameters are kept in float32 (param_dtype) either way."""


def hf_directory(load_from: object) -> Path | None:
    """The directory of checkpoint.load_from=hf:DIR, or None for any other value (the schema judges those)."""
    if not isinstance(load_from, str) or not load_from.startswith(HF_PREFIX):
        return None
    return Path(load_from[len(HF_PREFIX):]).expanduser()


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    """`DIR/config.json` as a dict; ConfigError when the directory or the file is missing or unreadable."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"{directory} is not a directory (valid: a Hugging Face checkpoint directory holding "
                          "config.json and *.safetensors)")
    path = directory / "config.json"
    if not path.is_file():
        raise ConfigError(f"{directory} has no config.json (valid: a Hugging Face checkpoint directory holding "
                          "config.json and *.safetensors)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path} is not readable JSON: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} holds {type(data).__name__}, not a JSON object")
    return data


def family(hf: Mapping[str, Any]) -> str:
    """The checkpoint's model_type, checked against the supported families."""
    kind = hf.get("model_type")
    if kind not in FAMILIES:
        arch = hf.get("architectures") or []
        named = f"model_type={kind!r}" + (f" (architectures {arch})" if arch else "")
        raise ConfigError(f"unsupported architecture: {named} (supported model_type: "
                          f"{', '.join(f'{k} ({v})' for k, v in FAMILIES.items())})")
    return kind


def _rope(hf: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, our rope_scaling section or None) from either layout."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"config.json: rope_parameters={params!r} is not an object")
    if "full_attention" in params:  # per-layer-type parameters (models mixing sliding and full attention)
        params = params["full_attention"]
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return float(theta), None
    if kind == "linear":
        return float(theta), {"type": "linear", "factor": float(scaling["factor"])}
    if kind == "llama3":
        return float(theta), {"type": "llama3", "factor": float(scaling["factor"]),
                              "low_freq_factor": float(scaling.get("low_freq_factor", 1.0)),
                              "high_freq_factor": float(scaling.get("high_freq_factor", 4.0)),
                              "original_max_position": int(scaling["original_max_position_embeddings"])}
    raise ConfigError(f"config.json: rope scaling type {kind!r} is not supported (supported: default, linear, "
                      "llama3)")


def _refuse(hf: Mapping[str, Any], key: str, allowed: Any, why: str) -> None:
    value = hf.get(key, allowed)
    if value != allowed:
        raise ConfigError(f"config.json: {key}={value!r} is not supported ({why}; valid: {allowed!r})")


def _sliding_window(hf: Mapping[str, Any], kind: str) -> int | None:
    if kind in ("qwen2", "qwen3"):
        types = hf.get("layer_types") or []
        uses = hf.get("use_sliding_window", False) or "sliding_attention" in types
        return int(hf["sliding_window"]) if uses and hf.get("sliding_window") else None
    window = hf.get("sliding_window")
    return int(window) if window else None


def model_section(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Our `model` section (a dict, as in a YAML file) for a Hugging Face config.json."""
    kind = family(hf)
    try:
        return _model_section(hf, kind)
    except KeyError as err:
        raise ConfigError(f"config.json of a {kind} model lacks {err.args[0]!r}") from None
    except (TypeError, ValueError) as err:
        raise ConfigError(f"config.json of a {kind} model has a value of the wrong type: {err}") from None


def _model_section(hf: Mapping[str, Any], kind: str) -> dict[str, Any]:
    _refuse(hf, "hidden_act", "silu", "the MLP is SwiGLU")
    _refuse(hf, "mlp_bias", False, "the MLP has no biases")
    _refuse(hf, "pretraining_tp", 1, "the projections are not split")
    if kind != "qwen2":
        _refuse(hf, "attention_bias", False, "only Qwen2's Q/K/V biases are implemented")
    heads = int(hf["num_attention_heads"])
    theta, scaling = _rope(hf)
    dtype = hf.get("dtype", hf.get("torch_dtype")) or "float32"
    if dtype not in _DTYPES:
        raise ConfigError(f"config.json: dtype={dtype!r} is not supported (valid: {', '.join(_DTYPES)})")
    model: dict[str, Any] = {
        "num_layers": int(hf["num_hidden_layers"]), "d_model": int(hf["hidden_size"]), "num_heads": heads,
        "num_kv_heads": int(hf.get("num_key_value_heads") or heads), "d_ff": int(hf["intermediate_size"]),
        "vocab_size": int(hf["vocab_size"]), "rope_theta": theta, "rope_scaling": scaling,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qkv_bias": kind == "qwen2", "qk_norm": kind == "qwen3", "sliding_window": _sliding_window(hf, kind),
        "compute_dtype": _DTYPES[dtype], "param_dtype": "float32",
    }
    head_dim = hf.get("head_dim")
    if head_dim and int(head_dim) != model["d_model"] // heads:
        model["head_dim"] = int(head_dim)
    if kind == "mixtral":
        _refuse(hf, "router_jitter_noise", 0.0, "routing is deterministic")
        # Mixtral's recipe has the load-balancing loss at router_aux_loss_coef and no router z-loss.
        model["moe"] = {"every": 1, "num_experts": int(hf["num_local_experts"]),
                        "experts_per_token": int(hf["num_experts_per_tok"]), "d_ff": int(hf["intermediate_size"]),
                        "router_score": "softmax", "router_aux_weight": float(hf.get("router_aux_loss_coef", 0.02)),
                        "router_z_weight": 0.0}
    return model


def infer_family(model: ModelConfig) -> str:
    """The Hugging Face family a model of ours exports as, or ConfigError naming what none of them has."""
    if model.moe is not None:
        if model.moe.every != 1 or model.moe.num_shared_experts or model.moe.router_score != "softmax":
            raise ConfigError("a mixture-of-experts model exports as Mixtral, which has an MoE layer in every layer, "
                              f"no shared experts and softmax routing (this one: model.moe.every={model.moe.every}, "
                              f"num_shared_experts={model.moe.num_shared_experts}, "
                              f"router_score={model.moe.router_score})")
        if model.qkv_bias or model.qk_norm:
            raise ConfigError("Mixtral has neither Q/K/V biases nor Q/K norms (model.qkv_bias and model.qk_norm "
                              "must be false to export a mixture-of-experts model)")
        return "mixtral"
    if model.qkv_bias and model.qk_norm:
        raise ConfigError("no supported family has both Q/K/V biases (Qwen2) and Q/K norms (Qwen3)")
    if model.qkv_bias:
        return "qwen2"
    if model.qk_norm:
        return "qwen3"
    return "mistral" if model.sliding_window else "llama"


def hf_config(model: ModelConfig, base: Mapping[str, Any] | None = None, *, dtype: str) -> dict[str, Any]:
    """The config.json of `model` saved in `dtype`: `base` (the imported checkpoint's, when there was one)
    with every architecture field rewritten, in the layout `base` used (legacy when there is none)."""
    kind = family(base) if base else infer_family(model)
    if (kind == "mixtral" and model.moe is None) or (kind != "mixtral" and model.moe is not None):
        kind = infer_family(model)
    out = dict(base or {})
    legacy = not base or "rope_parameters" not in base
    for key in ("rope_parameters", "rope_scaling", "rope_theta", "dtype", "torch_dtype", "head_dim"):
        out.pop(key, None)
    out.update({"architectures": [FAMILIES[kind]], "model_type": kind, "hidden_act": "silu",
                "num_hidden_layers": model.num_layers, "hidden_size": model.d_model,
                "num_attention_heads": model.num_heads, "num_key_value_heads": model.num_kv_heads,
                "head_dim": model.resolved_head_dim, "intermediate_size": model.d_ff,
                "vocab_size": model.vocab_size, "rms_norm_eps": model.norm_eps,
                "tie_word_embeddings": model.tie_embeddings})
    scaling = None
    if model.rope_scaling is not None:
        s = model.rope_scaling
        scaling = ({"rope_type": "linear", "factor": s.factor} if s.type == "linear" else
                   {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                    "high_freq_factor": s.high_freq_factor,
                    "original_max_position_embeddings": s.original_max_position})
    if legacy:
        out.update({"rope_theta": model.rope_theta, "rope_scaling": scaling, "torch_dtype": dtype})
    else:
        out.update({"rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta, **(scaling or {})},
                    "dtype": dtype})
    if kind == "mixtral":
        out.update({"num_local_experts": model.moe.num_experts, "num_experts_per_tok": model.moe.experts_per_token,
                    "intermediate_size": model.resolved_moe_d_ff,
                    "router_aux_loss_coef": model.moe.router_aux_weight})
    if kind in ("qwen2", "qwen3"):
        out["use_sliding_window"] = model.sliding_window is not None
        if model.sliding_window is not None:
            out["sliding_window"] = model.sliding_window
        types = out.get("layer_types") or []
        if len(types) != model.num_layers or (model.sliding_window is None and set(types) != {"full_attention"}):
            out.pop("layer_types", None)  # per-layer attention kinds no longer describe this model
    elif kind in ("mistral", "mixtral"):
        out["sliding_window"] = model.sliding_window
    if kind in ("llama", "qwen3"):  # the families whose config has the field
        out["attention_bias"] = False
    return out


def same_architecture(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Fields where two config.json files give different `model` sections ({} when equivalent)."""
    x, y = model_section(a), model_section(b)
    return {k: (x.get(k), y.get(k)) for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)}

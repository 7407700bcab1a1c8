"""Hugging Face `config.json` <-> our `model` section, for the families `config.families` registers (Llama, Mistral,
Qwen2, Qwen3, Mixtral, Qwen3-MoE, Gemma 3, DeepSeek-V3, DeepSeek-V2, gpt-oss).

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

from spmd_train.config.families import Family, families, family_named, refuse_field
from spmd_train.config.model_schema import ModelConfig
from spmd_train.errors import ConfigError

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


def family(hf: Mapping[str, Any]) -> Family:
    """The registered family of the checkpoint's model_type (ConfigError naming the supported ones for any other)."""
    kind = hf.get("model_type")
    found = family_named(kind)
    if found is None:
        arch = hf.get("architectures") or []
        named = f"model_type={kind!r}" + (f" (architectures {arch})" if arch else "")
        raise ConfigError(f"unsupported architecture: {named} (supported model_type: "
                          f"{', '.join(f'{f.model_type} ({f.architecture})' for f in families())})")
    return found


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
    if kind == "yarn":
        original = scaling.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
        factor = scaling.get("factor") or int(hf["max_position_embeddings"]) / int(original)  # DeepSeek-V3's rule
        out = {"type": "yarn", "factor": float(factor), "original_max_position": int(original),
               "beta_fast": float(scaling.get("beta_fast") or 32.0),
               "beta_slow": float(scaling.get("beta_slow") or 1.0), "truncate": bool(scaling.get("truncate", True))}
        out |= {key: float(scaling[key]) for key in ("mscale", "mscale_all_dim", "attention_factor")
                if scaling.get(key) is not None}
        return float(theta), out
    raise ConfigError(f"config.json: rope scaling type {kind!r} is not supported (supported: default, linear, "
                      "llama3, yarn)")


_HF_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}


def _attention_layers(hf: Mapping[str, Any], window: int | None, layers: int) -> dict[str, Any]:
    """model.sliding_window and model.layer_types from config.json: its `layer_types` when it lists them (Qwen's
    derived from max_window_layers when it does not: layers from that index on slide), else every layer sliding
    when the family's window is set (Mistral)."""
    if window is None:
        return {"sliding_window": None}
    names = hf.get("layer_types")
    if names is None and hf.get("sliding_window_pattern"):  # Gemma 2/3 configs before layer_types: every n-th full
        every = int(hf["sliding_window_pattern"])
        names = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    if names is None and hf.get("max_window_layers") is not None and hf.get("use_sliding_window"):
        names = ["sliding_attention" if i >= int(hf["max_window_layers"]) else "full_attention" for i in range(layers)]
    if not names:
        return {"sliding_window": window}
    unknown = sorted({n for n in names if n not in _HF_LAYER_TYPES})
    if unknown or len(names) != layers:
        raise ConfigError(f"config.json: layer_types={list(names)} is not one entry per layer of "
                          f"{', '.join(_HF_LAYER_TYPES)} (num_hidden_layers={layers})")
    kinds = tuple(_HF_LAYER_TYPES[n] for n in names)
    if "sliding" not in kinds:
        return {"sliding_window": None}
    return {"sliding_window": window, **({"layer_types": kinds} if "full" in kinds else {})}


def _local_rope_theta(hf: Mapping[str, Any], theta: float) -> float | None:
    """The sliding layers' RoPE base when config.json gives them their own (rope_local_base_freq, or rope_parameters
    per layer type), else None."""
    params = hf.get("rope_parameters") or {}
    local = params.get("sliding_attention", {}).get("rope_theta") if isinstance(params, Mapping) else None
    local = hf.get("rope_local_base_freq", local)
    return None if local is None or float(local) == theta else float(local)


def model_section(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Our `model` section (a dict, as in a YAML file) for a Hugging Face config.json."""
    fam = family(hf)
    try:
        return _model_section(hf, fam)
    except ConfigError:  # already names its field (a ValueError too, but not of the wrong type)
        raise
    except KeyError as err:
        raise ConfigError(f"config.json of a {fam.model_type} model lacks {err.args[0]!r}") from None
    except (TypeError, ValueError) as err:
        raise ConfigError(f"config.json of a {fam.model_type} model has a value of the wrong type: {err}") from None


QUANTIZATIONS = ("mxfp4",)
"""config.json's quantization_config.quant_method values whose tensors `hf.files` reads (dequantized)."""


def _model_section(hf: Mapping[str, Any], fam: Family) -> dict[str, Any]:
    quantization = hf.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, Mapping) else quantization
        if method not in QUANTIZATIONS:
            raise ConfigError(f"config.json: quantization_config.quant_method={method!r} is not supported (valid: "
                              f"{', '.join(QUANTIZATIONS)}, read dequantized; or an unquantized checkpoint)")
    refuse_field(hf, "hidden_act", "silu", "the MLP is SwiGLU")
    refuse_field(hf, "mlp_bias", False, "the MLP has no biases")
    refuse_field(hf, "pretraining_tp", 1, "the projections are not split")
    if not fam.qkv_bias:
        biased = " and ".join(f.title for f in families() if f.qkv_bias)
        refuse_field(hf, "attention_bias", False, f"only {biased}'s Q/K/V biases are implemented")
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
        "qkv_bias": fam.qkv_bias, "qk_norm": fam.qk_norm,
        **_attention_layers(hf, fam.window(hf), int(hf["num_hidden_layers"])),
        "compute_dtype": _DTYPES[dtype], "param_dtype": "float32",
    }
    local_theta = _local_rope_theta(hf, theta)
    if local_theta is not None and "sliding" in model.get("layer_types", ("sliding",) * bool(model["sliding_window"])):
        model["rope_local_theta"] = local_theta
    head_dim = hf.get("head_dim")
    if head_dim and int(head_dim) != model["d_model"] // heads:
        model["head_dim"] = int(head_dim)
    fam.read(hf, model)
    return model


VARIANTS = {"attention_sinks": False, "attn_output_bias": False, "attn_logit_softcap": None,
            "final_logit_softcap": None, "query_pre_attn_scalar": None, "rope_local_theta": None,
            "norm_plus_one": False, "sandwich_norms": False, "scale_embeddings": False, "mlp_activation": "silu"}
"""Model fields beyond what every family's config.json holds, with their plain values: a family writes a model that
sets one only when it lists it in `Family.holds`."""


def unexportable(model: ModelConfig, fam: Family | None = None) -> str | None:
    """Why no registered family (or `fam`) can hold this model's variants, or None when one can: the fields of
    `VARIANTS` set away from their plain values that no family (or `fam`) holds, MLA ("mla" in `Family.holds`), and a
    mix of full and sliding layers in a family without per-layer kinds (`Family.layer_types`)."""
    holders = [fam] if fam is not None else list(families())
    keys = [k for k, plain in VARIANTS.items() if getattr(model, k) != plain]
    keys += ["mla"] if model.mla is not None else []
    keys = [k for k in keys if not any(k in f.holds for f in holders)]
    held = [f"model.{k}" if k == "mla" else f"model.{k}={getattr(model, k)}" for k in keys]
    if held:
        if fam is None:
            return (f"no supported Hugging Face family (supported model_type: "
                    f"{', '.join(f.model_type for f in families())}) holds {', '.join(held)}; the model trains, it "
                    "does not export")
        others = [f"{f.title} ({f.model_type})" for f in families() if set(keys) <= f.holds]
        where = f" (held by {', '.join(others)}, with its other settings)" if others else ""
        return f"{fam.title} ({fam.model_type}) cannot hold {', '.join(held)}{where}; the model trains, it does not " \
               "export as it"
    if fam is not None and len(model.attention_kinds) > 1 and not fam.layer_types:
        return (f"{fam.title}'s config.json has no per-layer attention kinds, and model.layer_types="
                f"{list(model.layer_types)} mixes full and sliding layers")
    return None


def infer_family(model: ModelConfig) -> Family:
    """The Hugging Face family a model of ours exports as: the first registered one that claims it (`Family.claims`)
    and can hold it (`unexportable`, `Family.refusal`); ConfigError with the reason of the first claimant that holds
    its variant fields (else of the first claimant), or naming what none has."""
    why = unexportable(model)
    if why is not None:
        raise ConfigError(why)
    claimants = [fam for fam in families() if fam.claims(model)]
    reasons = []
    for fam in claimants:
        variants = unexportable(model, fam)
        refusal = variants or fam.refusal(model)
        if refusal is None:
            return fam
        reasons.append((variants is not None, refusal))
    if reasons:
        raise ConfigError(min(reasons, key=lambda r: r[0])[1])  # a claimant holding the variants says it best
    raise ConfigError(f"no supported family (model_type {', '.join(f.model_type for f in families())}) has this "
                      f"model's features (model.qkv_bias={model.qkv_bias}, qk_norm={model.qk_norm}, "
                      f"sliding_window={model.sliding_window}, moe={'set' if model.moe else 'null'})")


def hf_config(model: ModelConfig, base: Mapping[str, Any] | None = None, *, dtype: str) -> dict[str, Any]:
    """The config.json of `model` saved in `dtype`: `base` (the imported checkpoint's, when there was one)
    with every architecture field rewritten, in the layout `base` used (legacy when there is none)."""
    fam = family(base) if base else infer_family(model)
    if fam.moe != (model.moe is not None) or unexportable(model, fam):  # the imported family cannot hold it
        fam = infer_family(model)
    why = unexportable(model, fam)
    if why is not None:
        raise ConfigError(why)
    out = dict(base or {})
    legacy = not base or "rope_parameters" not in base
    # Export writes every tensor unquantized, whatever the imported checkpoint's quantization_config said.
    for key in ("rope_parameters", "rope_scaling", "rope_theta", "dtype", "torch_dtype", "head_dim",
                "quantization_config"):
        out.pop(key, None)
    out.update({"architectures": [fam.architecture], "model_type": fam.model_type, "hidden_act": "silu",
                "num_hidden_layers": model.num_layers, "hidden_size": model.d_model,
                "num_attention_heads": model.num_heads, "num_key_value_heads": model.num_kv_heads,
                "head_dim": model.resolved_head_dim, "intermediate_size": model.d_ff,
                "vocab_size": model.vocab_size, "rms_norm_eps": model.norm_eps,
                "tie_word_embeddings": model.tie_embeddings})
    scaling = None
    if model.rope_scaling is not None:
        scaling = _write_rope_scaling(model.rope_scaling)
    if legacy:
        out.update({"rope_theta": model.rope_theta, "rope_scaling": scaling, "torch_dtype": dtype})
    else:
        out.update({"rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta, **(scaling or {})},
                    "dtype": dtype})
    fam.write(model, out)
    return out


def _write_rope_scaling(s: Any) -> dict[str, Any]:
    """Our rope_scaling section as config.json's (`rope_type` and `transformers`' key names)."""
    if s.type == "linear":
        return {"rope_type": "linear", "factor": s.factor}
    if s.type == "llama3":
        return {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_position}
    out = {"rope_type": "yarn", "factor": s.factor, "original_max_position_embeddings": s.original_max_position,
           "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, **({} if s.truncate else {"truncate": False})}
    return out | {key: getattr(s, key) for key in ("mscale", "mscale_all_dim", "attention_factor")
                  if getattr(s, key) is not None}


def same_architecture(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Fields where two config.json files give different `model` sections ({} when equivalent)."""
    x, y = model_section(a), model_section(b)
    return {k: (x.get(k), y.get(k)) for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)}

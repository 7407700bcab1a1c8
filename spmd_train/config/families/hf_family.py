"""A Hugging Face model family as data: `Family` (its config.json fields and tensor names, both ways), registered
by its own module of `config.families`.

Our model is one architecture with switches (model.qkv_bias, qk_norm, sliding_window, moe); a family is a
setting of those switches that `transformers` names, with its own config.json fields and tensor names.
`config.hf_config` reads and writes config.json through the family, `hf.names` lays out its tensors. No jax
here: the config loader reads this before jax starts (docs/howto/add-a-model-family.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from spmd_train.config.model_schema import ModelConfig
from spmd_train.errors import ConfigError
from spmd_train.registry import Registry

Row = tuple[str, str, str]
"""(our parameter path under `blocks.`, the tensor's name under the layer prefix, its layout: one of `hf.names.Layout`'s
kinds: same, transpose, heads_in, heads_out, heads; "+rope" after it when the last rotary dimensions are stored in
interleaved pairs)."""


@dataclass(frozen=True)
class TensorNames:
    """Where a family's checkpoints keep each tensor; the defaults are Llama's, which every family here shares."""

    layer: tuple[Row, ...] = (("attn_norm.scale", "input_layernorm.weight", "same"),
                              ("mlp_norm.scale", "post_attention_layernorm.weight", "same"),
                              ("attn.wq", "self_attn.q_proj.weight", "heads_in"),
                              ("attn.wk", "self_attn.k_proj.weight", "heads_in"),
                              ("attn.wv", "self_attn.v_proj.weight", "heads_in"),
                              ("attn.wo", "self_attn.o_proj.weight", "heads_out"))
    """Every layer's norms and attention projections."""
    qkv_bias: tuple[Row, ...] = (("attn.bq", "self_attn.q_proj.bias", "heads"),
                                 ("attn.bk", "self_attn.k_proj.bias", "heads"),
                                 ("attn.bv", "self_attn.v_proj.bias", "heads"))
    """With model.qkv_bias."""
    qk_norm: tuple[Row, ...] = (("attn.q_norm.scale", "self_attn.q_norm.weight", "same"),
                                ("attn.k_norm.scale", "self_attn.k_norm.weight", "same"))
    """With model.qk_norm."""
    mlp: tuple[Row, ...] = (("mlp.w_gate", "mlp.gate_proj.weight", "transpose"),
                            ("mlp.w_up", "mlp.up_proj.weight", "transpose"),
                            ("mlp.w_down", "mlp.down_proj.weight", "transpose"))
    """A dense layer's SwiGLU."""
    router: str = ""
    """An MoE layer's router weight (transposed)."""
    expert: str = ""
    """An MoE layer's expert weight, a format of {e} (the expert) and {w} (its name in `expert_weights`)."""
    expert_weights: tuple[tuple[str, str], ...] = ()
    """(our path under `blocks.`, {w}) of each expert weight (transposed), in file order."""
    router_bias: str = ""
    """An MoE layer's selection bias (model.moe.bias_update_rate set: DeepSeek-V3's e_score_correction_bias)."""
    shared: tuple[Row, ...] = ()
    """An MoE layer's shared experts, as one SwiGLU (model.moe.num_shared_experts)."""
    mtp: tuple[Row, ...] = ()
    """A multi-token prediction module's own tensors (model.mtp), under the layer prefix of layer num_layers + k
    beside its layer's (DeepSeek-V3's `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`); empty: the family's
    checkpoints hold no such modules, and export leaves them out."""
    mtp_copies: tuple[Row, ...] = ()
    """What a multi-token prediction module stores again of the shared tables (DeepSeek-V3's `embed_tokens` and
    `shared_head.head`): written at export, not read at import (the trunk's own tensors are)."""
    layer_prefix: str = "model.layers.{i}."
    embedding: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    lm_head: str = "lm_head.weight"


LLAMA_TENSORS = TensorNames()


def plain_window(hf: Mapping[str, Any]) -> int | None:
    """config.json's sliding_window, when set (Mistral, Mixtral)."""
    window = hf.get("sliding_window")
    return int(window) if window else None


def qwen_window(hf: Mapping[str, Any]) -> int | None:
    """Qwen's sliding_window, which counts only with use_sliding_window or a sliding layer in layer_types."""
    types = hf.get("layer_types") or []
    uses = hf.get("use_sliding_window", False) or "sliding_attention" in types
    return int(hf["sliding_window"]) if uses and hf.get("sliding_window") else None


def write_plain_window(model: ModelConfig, out: dict[str, Any]) -> None:
    """sliding_window as config.json has it, null for none (Mistral, Mixtral)."""
    out["sliding_window"] = model.sliding_window


def hf_layer_types(model: ModelConfig) -> list[str]:
    """config.json's layer_types: each layer's attention as transformers names it (sliding_attention or
    full_attention)."""
    return [f"{kind}_attention" for kind in model.layer_kinds]


def write_qwen_window(model: ModelConfig, out: dict[str, Any]) -> None:
    """Qwen's use_sliding_window, sliding_window and per-layer layer_types (max_window_layers is read only when
    layer_types is absent, so the list alone says which layers slide)."""
    out["use_sliding_window"] = model.sliding_window is not None
    if model.sliding_window is not None:
        out["sliding_window"] = model.sliding_window
        out["layer_types"] = hf_layer_types(model)
        return
    types = out.get("layer_types") or []
    if len(types) != model.num_layers or set(types) != {"full_attention"}:
        out.pop("layer_types", None)  # per-layer attention kinds no longer describe this model


def refuse_field(hf: Mapping[str, Any], key: str, allowed: Any, why: str) -> None:
    """ConfigError when config.json sets `key` to anything but `allowed` (absent counts as allowed)."""
    value = hf.get(key, allowed)
    if value != allowed:
        raise ConfigError(f"config.json: {key}={value!r} is not supported ({why}; valid: {allowed!r})")


def unplain_moe(moe: Any, title: str, *, norm_topk_prob: bool | None = None) -> str | None:
    """Why family `title`, with a plain top-k router and SwiGLU experts, cannot hold `moe` (a `MoEConfig`): the
    settings it cannot express (DeepSeek-V3's selection bias, groups, routed scaling and dense first layers;
    gpt-oss's router and expert biases and clamped SwiGLU; norm_topk_prob when the family fixes it), or None."""
    plain = {"routed_scaling_factor": 1.0, "bias_update_rate": None, "first_k_dense": 0, "router_logit_bias": False,
             "expert_bias": False, "swiglu_limit": None}
    if norm_topk_prob is not None:
        plain = {"norm_topk_prob": norm_topk_prob, **plain}
    unlike = [f"{key}={getattr(moe, key)}" for key, value in plain.items() if getattr(moe, key) != value]
    unlike += [f"topk_group={moe.topk_group}"] if moe.topk_group < moe.n_group else []
    if not unlike:
        return None
    valid = ", ".join(f"{key}={'null' if value is None else str(value).lower()}" for key, value in plain.items())
    return (f"{title} routes without a selection bias, groups, scaling, dense first layers or biases, and its experts "
            f"are plain SwiGLU (this one: model.moe.{', '.join(unlike)}; valid for {title}: {valid}, "
            "topk_group=n_group)")


def _nothing(*args: Any) -> None:
    return None


def _no_prefixes(hf: Mapping[str, Any], model: ModelConfig) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class Family:
    """A Hugging Face model family: config.json <-> our `model` section, and its tensor names."""

    model_type: str
    """config.json's model_type."""
    architecture: str
    """The `transformers` class its checkpoints load into (config.json's architectures)."""
    title: str
    """How messages name it ("Qwen2")."""
    claims: Callable[[ModelConfig], bool]
    """Whether export may write a model of ours with these switches as this family: a model exports as the first
    registered family that claims it and does not refuse it (`refusal`), so registration order decides between two
    that could (Llama before Mistral)."""
    qkv_bias: bool = False
    """Its attention has Q/K/V biases (model.qkv_bias); the others refuse config.json's attention_bias=true."""
    qk_norm: bool = False
    """Its attention has RMSNorms on each head's query and key (model.qk_norm)."""
    moe: bool = False
    """Its MLPs are mixtures of experts in every layer (model.moe)."""
    window: Callable[[Mapping[str, Any]], int | None] = plain_window
    """model.sliding_window from its config.json."""
    layer_types: bool = False
    """Its config.json says which layers slide (`layer_types`), so it holds a mix of full and sliding layers."""
    read: Callable[[Mapping[str, Any], dict[str, Any]], None] = _nothing
    """read(config.json, model section): its own fields into our model section (Mixtral's experts), refusing
    the ones that change the computation and that the model does not implement."""
    write: Callable[[ModelConfig, dict[str, Any]], None] = _nothing
    """write(model, config.json): its own fields from our model (experts, window, attention_bias)."""
    refusal: Callable[[ModelConfig], str | None] = _nothing
    """Why a model it claims cannot be written as it (None: it can); export raises the first claimant's refusal
    when every claimant refuses."""
    tensors: TensorNames = field(default=LLAMA_TENSORS)
    """Where its checkpoints keep each tensor (`hf.names.pieces`)."""
    unread: Callable[[Mapping[str, Any], ModelConfig], tuple[str, ...]] = _no_prefixes
    """unread(config.json, the model imported into): name prefixes of tensors its checkpoints carry that import leaves
    unread (DeepSeek-V3's multi-token-prediction layers beyond model.mtp's depth)."""
    holds: frozenset[str] = frozenset()
    """The model variant fields (`config.hf_config.VARIANTS`) its config.json can express when set (Gemma 3's
    soft-caps, query scale, local RoPE and norms); a model setting any other is not exported as it."""


_FAMILIES: Registry[Family] = Registry("model_type", key=lambda family: family.model_type)
register_family = _FAMILIES.add
"""Add a family (ValueError for a model_type already taken)."""


def families() -> tuple[Family, ...]:
    """Every registered family, in registration order (the order messages list them in and export tries them)."""
    return tuple(_FAMILIES)


def family_named(model_type: object) -> Family | None:
    """The family registered as `model_type` (None for any other value)."""
    return _FAMILIES.get(model_type) if isinstance(model_type, str) else None

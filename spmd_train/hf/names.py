"""Which Hugging Face tensor fills which slice of which of our parameters, and how it is laid out.

`transformers` stores a linear layer's weight as [out, in] and each layer's tensors apart; we store
[in, out] with heads split out, each kind of tensor stacked over layers (and experts). Its rotary
layout (rotate-half, what its Llama converter permutes Meta's weights into) is ours, so no
permutation is needed here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from spmd_train.config.model_schema import ModelConfig


@dataclass(frozen=True)
class Layout:
    """How one Hugging Face tensor becomes one slice of ours: a transpose, a split of fused heads, or nothing."""

    kind: str
    """same | transpose (linear [out, in] -> [in, out]) | heads_in (q/k/v [heads*hd, d] -> [d, heads, hd]) |
    heads_out (o [d, heads*hd] -> [heads, hd, d]) | heads (bias [heads*hd] -> [heads, hd])."""

    def to_ours(self, x: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
        """The Hugging Face tensor as our slice of shape `ours` (a view where numpy can give one)."""
        if self.kind == "same":
            return x
        if self.kind == "transpose":
            return x.T
        if self.kind == "heads_in":
            d, h, hd = ours
            return x.reshape(h, hd, d).transpose(2, 0, 1)
        if self.kind == "heads_out":
            h, hd, d = ours
            return x.reshape(d, h, hd).transpose(1, 2, 0)
        return x.reshape(ours)  # heads

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        """Our slice as the Hugging Face tensor (contiguous, ready to write)."""
        if self.kind == "transpose":
            x = x.T
        elif self.kind == "heads_in":
            x = x.transpose(1, 2, 0).reshape(-1, x.shape[0])
        elif self.kind == "heads_out":
            x = x.transpose(2, 0, 1).reshape(x.shape[2], -1)
        elif self.kind == "heads":
            x = x.reshape(-1)
        return np.ascontiguousarray(x)

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        """The Hugging Face tensor's shape for our slice of shape `ours`."""
        if self.kind == "transpose":
            return tuple(reversed(ours))
        if self.kind == "heads_in":
            return (ours[1] * ours[2], ours[0])
        if self.kind == "heads_out":
            return (ours[2], ours[0] * ours[1])
        if self.kind == "heads":
            return (math.prod(ours),)
        return tuple(ours)


@dataclass(frozen=True)
class Piece:
    """One Hugging Face tensor: the parameter it fills, where in its stacked leading axes, and its layout."""

    hf_name: str
    path: str
    """Our parameter, dot-joined as in `Engine.param_shapes` (e.g. blocks.attn.wq)."""
    index: tuple[int, ...]
    """Position on the parameter's stacked leading axes (model layer, then expert); () for unstacked ones."""
    layout: Layout


SAME, T = Layout("same"), Layout("transpose")
_LAYER = {  # our path under blocks. -> (Hugging Face name under model.layers.{i}., layout)
    "attn_norm.scale": ("input_layernorm.weight", SAME),
    "mlp_norm.scale": ("post_attention_layernorm.weight", SAME),
    "attn.wq": ("self_attn.q_proj.weight", Layout("heads_in")),
    "attn.wk": ("self_attn.k_proj.weight", Layout("heads_in")),
    "attn.wv": ("self_attn.v_proj.weight", Layout("heads_in")),
    "attn.wo": ("self_attn.o_proj.weight", Layout("heads_out")),
}
_QKV_BIAS = {"attn.bq": ("self_attn.q_proj.bias", Layout("heads")),
             "attn.bk": ("self_attn.k_proj.bias", Layout("heads")),
             "attn.bv": ("self_attn.v_proj.bias", Layout("heads"))}
_QK_NORM = {"attn.q_norm.scale": ("self_attn.q_norm.weight", SAME),
            "attn.k_norm.scale": ("self_attn.k_norm.weight", SAME)}
_MLP = {"mlp.w_gate": ("mlp.gate_proj.weight", T), "mlp.w_up": ("mlp.up_proj.weight", T),
        "mlp.w_down": ("mlp.down_proj.weight", T)}
_EXPERTS = {"mlp.w_gate": "w1", "mlp.w_up": "w3", "mlp.w_down": "w2"}
"""Mixtral's per-expert names: w1 is the gate, w3 the up projection, w2 the down projection."""


def pieces(model: ModelConfig) -> Iterator[Piece]:
    """Every Hugging Face tensor of a checkpoint of `model`, in file order (embedding, layers, norm, head)."""
    if model.moe is not None and model.moe.every != 1:
        raise ValueError("Hugging Face checkpoints have an MoE layer in every layer or none (model.moe.every=1)")
    yield Piece("model.embed_tokens.weight", "embedding", (), SAME)
    per_layer = dict(_LAYER)
    if model.qkv_bias:
        per_layer.update(_QKV_BIAS)
    if model.qk_norm:
        per_layer.update(_QK_NORM)
    for i in range(model.num_layers):
        at = f"model.layers.{i}."
        for path, (name, layout) in per_layer.items():
            yield Piece(at + name, f"blocks.{path}", (i,), layout)
        if model.moe is None:
            for path, (name, layout) in _MLP.items():
                yield Piece(at + name, f"blocks.{path}", (i,), layout)
            continue
        yield Piece(at + "block_sparse_moe.gate.weight", "blocks.mlp.router", (i,), T)
        for e in range(model.moe.num_experts):
            for path, w in _EXPERTS.items():
                yield Piece(f"{at}block_sparse_moe.experts.{e}.{w}.weight", f"blocks.{path}", (i, e), T)
    yield Piece("model.norm.weight", "final_norm.scale", (), SAME)
    if not model.tie_embeddings:
        yield Piece("lm_head.weight", "lm_head", (), T)


IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
"""Buffers older `transformers` versions saved with the weights; recomputed from the config here."""

"""Which Hugging Face tensor fills which slice of which of our parameters, and how it is laid out.

`transformers` stores a linear layer's weight as [out, in] and each layer's tensors apart; we store
[in, out] with heads split out, each kind of tensor stacked over layers (and experts). Its rotary
layout (rotate-half, what its Llama converter permutes Meta's weights into) is ours, so no
permutation is needed here. Each family's names are its `Family.tensors` (`config.families`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from spmd_train.config.families import Family
from spmd_train.config.model_schema import ModelConfig
from spmd_train.models.param_specs import block_params, table_params

FUSED = {"evens": 0, "odds": 1}
"""The fused layouts, and the first column of each part."""


@dataclass(frozen=True)
class Layout:
    """How one Hugging Face tensor becomes one slice of ours: a transpose, a split of fused heads, or nothing."""

    kind: str
    """same | transpose (linear [out, in] -> [in, out]) | heads_in (q/k/v [heads*hd, d] -> [d, heads, hd]) |
    heads_out (o [d, heads*hd] -> [heads, hd, d]) | heads (bias [heads*hd] -> [heads, hd]) | evens, odds (one of
    two parameters fused column by column into one tensor: gpt-oss's gate_up_proj [..., 2f] holds the gate in its
    even columns, the up projection in its odd ones)."""
    rope: int = 0
    """The last `rope` entries of our last axis are rotary dimensions the checkpoint keeps in interleaved pairs
    (x0, x1), (x2, x3), ... (DeepSeek's rope_interleave): they become rotate-half's order, evens then odds."""

    def to_ours(self, x: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
        """The Hugging Face tensor as our slice of shape `ours` (a view where numpy can give one)."""
        out = self._to_ours(x, ours)
        return out[..., self._order(out.shape[-1])] if self.rope else out

    def _order(self, n: int) -> np.ndarray:
        # Rotate-half pairs dimension j with j + r/2; interleaved pairs 2j with 2j + 1: ours[j] = theirs[perm[j]].
        r = self.rope
        return np.concatenate([np.arange(n - r), n - r + np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])])

    def _to_ours(self, x: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
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
        if self.kind in FUSED:
            return x[..., FUSED[self.kind]::2]
        return x.reshape(ours)  # heads

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        """Our slice as the Hugging Face tensor (contiguous, ready to write)."""
        if self.rope:
            x = x[..., np.argsort(self._order(x.shape[-1]))]
        if self.kind == "transpose":
            x = x.T
        elif self.kind == "heads_in":
            x = x.transpose(1, 2, 0).reshape(-1, x.shape[0])
        elif self.kind == "heads_out":
            x = x.transpose(2, 0, 1).reshape(x.shape[2], -1)
        elif self.kind == "heads":
            x = x.reshape(-1)
        return np.ascontiguousarray(x)

    def into_hf(self, x: np.ndarray, tensor: np.ndarray | None = None) -> np.ndarray:
        """The Hugging Face tensor with our slice `x` in it: `to_hf`, or (evens, odds) its columns of `tensor`, which
        the other part of the fusion fills (a new one when None)."""
        if self.kind not in FUSED:
            return self.to_hf(x)
        if tensor is None:
            tensor = np.empty(self.hf_shape(x.shape), x.dtype)
        tensor[..., FUSED[self.kind]::2] = x
        return tensor

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        """The Hugging Face tensor's shape for our slice of shape `ours`."""
        if self.kind in FUSED:
            return (*ours[:-1], 2 * ours[-1])
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
    copy: bool = False
    """A second copy of a parameter another piece fills (DeepSeek-V3's MTP modules store the shared embedding and
    head again): written at export, its shape checked but not read at import."""


SAME, T = Layout("same"), Layout("transpose")


def pieces(model: ModelConfig, family: Family) -> Iterator[Piece]:
    """Every Hugging Face tensor of a checkpoint of `model` in `family`'s names (`Family.tensors`), in file order
    (embedding, layers, norm, head, then any multi-token prediction modules as layers num_layers + k); a fused tensor
    is two pieces of one name (`Layout.into_hf`). A row naming a parameter the model does not have (MLA's query latent
    when q_lora_rank is null) is skipped; model.moe.first_k_dense's layers fill `first_blocks`. model.mtp's modules
    are left out for a family whose checkpoints hold none."""
    if model.moe is not None and model.moe.every != 1:
        raise ValueError("Hugging Face checkpoints have an MoE layer in every layer after the dense first ones, or "
                         "none (model.moe.every=1)")
    names = family.tensors
    yield Piece(names.embedding, "embedding", (), SAME)
    for i in range(model.num_layers):
        stack, row = ("first_blocks", i) if i < model.first_dense else ("blocks", i - model.first_dense)
        yield from _layer(model, names, names.layer_prefix.format(i=i), stack, row, model.is_moe_layer(i))
    yield Piece(names.final_norm, "final_norm.scale", (), SAME)
    if not model.tie_embeddings:
        yield Piece(names.lm_head, "lm_head", (), T)
    if model.mtp is None or not names.mtp:
        return
    tables = table_params(model)
    for k in range(model.mtp.depth):
        at = names.layer_prefix.format(i=model.num_layers + k)
        for path, name, kind in names.mtp_copies:
            if path in tables:  # a tied model has no lm_head of its own to copy
                yield Piece(at + name, path, (), _layout(kind, model), copy=True)
        for path, name, kind in names.mtp:
            yield Piece(at + name, f"mtp.{path}", (k,), _layout(kind, model))
        yield from _layer(model, names, at, "mtp.block", k, model.moe_every > 0)


def _layer(model: ModelConfig, names, at: str, stack: str, row: int, moe: bool) -> Iterator[Piece]:
    """One layer's pieces: its tensors under the name prefix `at`, filling row `row` of our stack `stack`."""
    has = block_params(model, moe=moe)
    shared = names.shared if model.moe is not None and model.moe.num_shared_experts else ()
    rows = [*names.layer, *(names.qkv_bias if model.qkv_bias else ()), *(names.qk_norm if model.qk_norm else ()),
            *(() if moe else names.mlp), *(shared if moe else ())]
    for path, name, kind in rows:
        if path in has:
            yield Piece(at + name, f"{stack}.{path}", (row,), _layout(kind, model))
    if not moe:
        return
    if names.router:  # gpt-oss's router, a biased linear layer, is among its layer rows
        yield Piece(at + names.router, f"{stack}.mlp.router", (row,), T)
    if model.moe.router_bias:
        yield Piece(at + names.router_bias, f"{stack}.mlp.router_bias", (row,), SAME)
    for e in range(model.moe.num_experts):
        for path, w in names.expert_weights:
            yield Piece(at + names.expert.format(e=e, w=w), f"{stack}.{path}", (row, e), T)


def _layout(kind: str, model: ModelConfig) -> Layout:
    """A row's layout: its kind, with "+rope" for interleaved rotary dimensions at the end (`Layout.rope`)."""
    base, _, rope = kind.partition("+")
    return Layout(base, model.rope_head_dim if rope else 0)


def stored_index(piece: Piece, row: np.ndarray) -> tuple[int, ...]:
    """Where `piece` sits in the stored parameters: a `blocks` row mapped through `row` (the stored row of each model
    row, `Engine.stored_row_of_model`: pipeline layer orders and padding); other indices as they are."""
    if not piece.index or not piece.path.startswith("blocks."):
        return piece.index
    return (int(row[piece.index[0]]), *piece.index[1:])


IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
"""Buffers older `transformers` versions saved with the weights; recomputed from the config here."""

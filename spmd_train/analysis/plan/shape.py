"""The model as the planner sees it: every parameter's shape and logical axes, and the FLOPs per token.

`ModelShape.from_config` lists the parameters `models/transformer.py` creates, one `ParamGroup` per stacked
array, so the sharding arithmetic over them is the engine's (tests/test_plan_model.py compares them with
`Engine.param_shapes`). FLOPs per token are `models.flops.flops_per_token`, not derived again.

Derivation: docs/explanation/planner-model.md#the-models-shape
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from spmd_train.config.model_schema import ModelConfig
from spmd_train.models.flops import flops_per_token, matmul_params, moe_layer_count

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class ParamGroup:
    """One stacked parameter array: its path in the parameter tree, shape and logical axes."""

    path: str
    """Dot-joined keys, as in `Engine.param_shapes` (e.g. "blocks.attn.wq")."""
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    """Logical axis name of each dimension (`layers`/`sublayers` for the stacking dimensions)."""
    lookup_only: bool = False
    """An untied embedding table: used by a lookup only, so computing with it needs no second gather."""

    @property
    def numel(self) -> int:
        """Elements in the whole array."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelShape:
    """Dimensions, parameters and FLOPs of a model, with the dtypes it stores and computes in."""

    num_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    tie_embeddings: bool
    moe_layers: int
    num_experts: int
    experts_per_token: int
    moe_d_ff: int
    num_shared_experts: int
    param_bytes: int
    """Bytes per stored parameter (model.param_dtype)."""
    compute_bytes: int
    """Bytes per activation and per weight in its compute layout (model.compute_dtype)."""
    params: tuple[ParamGroup, ...]
    matmul_params: int
    """Parameters a token's matmuls use (`models.flops.matmul_params`): what '6N' counts."""
    attention_flops_per_position: float
    """Training FLOPs per token per position of context (`flops_per_token(m, s)` is linear in s)."""
    qkv_bias: bool = False
    """Biases on Q/K/V (model.qkv_bias)."""
    qk_norm: bool = False
    """Per-head RMSNorm scales on Q and K (model.qk_norm)."""

    @classmethod
    def from_config(cls, m: ModelConfig) -> ModelShape:
        """The shape of the model `m` describes, parameter by parameter as `Transformer` builds it."""
        moe = m.moe
        zero_flops = flops_per_token(m, 0)
        return cls(
            num_layers=m.num_layers, d_model=m.d_model, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
            head_dim=m.resolved_head_dim, d_ff=m.d_ff, vocab_size=m.vocab_size, tie_embeddings=m.tie_embeddings,
            moe_layers=moe_layer_count(m), num_experts=moe.num_experts if moe else 0,
            experts_per_token=moe.experts_per_token if moe else 0, moe_d_ff=m.resolved_moe_d_ff,
            num_shared_experts=moe.num_shared_experts if moe else 0,
            param_bytes=DTYPE_BYTES[m.param_dtype], compute_bytes=DTYPE_BYTES[m.compute_dtype],
            params=_param_groups(m), matmul_params=matmul_params(m),
            attention_flops_per_position=flops_per_token(m, 1) - zero_flops, qkv_bias=m.qkv_bias,
            qk_norm=m.qk_norm,
        )

    @property
    def total_params(self) -> int:
        """Every parameter, the embedding table(s) included."""
        return sum(g.numel for g in self.params)

    @property
    def embedding_params(self) -> int:
        """The vocabulary tables: the embedding, and the LM head when untied."""
        return sum(g.numel for g in self.params if g.path in ("embedding", "lm_head"))

    @property
    def dense_layer_params(self) -> int:
        """Parameters of one dense layer (norms, attention, SwiGLU MLP)."""
        d, hd = self.d_model, self.head_dim
        extras = hd * (self.num_heads + 2 * self.num_kv_heads) * self.qkv_bias + 2 * hd * self.qk_norm
        return 2 * d + d * hd * (2 * self.num_heads + 2 * self.num_kv_heads) + 3 * d * self.d_ff + extras

    @property
    def moe_layer_params(self) -> int:
        """Parameters of one MoE layer: a dense layer's, with the router and experts in place of the MLP."""
        d, f = self.d_model, self.moe_d_ff
        experts = d * self.num_experts + 3 * d * f * (self.num_experts + self.num_shared_experts)
        return self.dense_layer_params - 3 * d * self.d_ff + experts

    @property
    def active_params(self) -> int:
        """Parameters a token is active in, the input table excluded: `matmul_params` (the MFU convention)."""
        return self.matmul_params

    def __hash__(self) -> int:
        # Estimates cache per-parameter sums on (shape, layout): hash the fields once, not on every lookup.
        if "_hash" not in self.__dict__:
            self.__dict__["_hash"] = hash(tuple(getattr(self, f.name) for f in fields(self)))
        return self.__dict__["_hash"]

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at this context length (`models.flops.flops_per_token`)."""
        return 6.0 * self.matmul_params + self.attention_flops_per_position * seq_len


def _param_groups(m: ModelConfig) -> tuple[ParamGroup, ...]:
    """The parameters `Transformer(m)` creates, in the order of its tree."""
    d, v = m.d_model, m.vocab_size
    groups = [ParamGroup("embedding", (v, d), ("vocab", "embed"), lookup_only=not m.tie_embeddings)]
    every, layers = m.moe_every, m.num_layers
    if every == 0:
        groups += _block(m, "blocks", (layers,), moe=False)
    elif every == 1:
        groups += _block(m, "blocks", (layers,), moe=True)
    else:
        groups += _block(m, "blocks.dense", (layers // every, every - 1), moe=False)
        groups += _block(m, "blocks.moe", (layers // every,), moe=True)
    groups.append(ParamGroup("final_norm.scale", (d,), ("embed",)))
    if not m.tie_embeddings:
        groups.append(ParamGroup("lm_head", (d, v), ("embed", "vocab")))
    return tuple(groups)


def _block(m: ModelConfig, prefix: str, stack: tuple[int, ...], *, moe: bool) -> list[ParamGroup]:
    """One `Block`'s parameters stacked `stack` times (`layers`, then `sublayers`)."""
    d, hd, h, kv = m.d_model, m.resolved_head_dim, m.num_heads, m.num_kv_heads
    lead = ("layers", "sublayers")[: len(stack)]

    def group(name: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> ParamGroup:
        return ParamGroup(f"{prefix}.{name}", (*stack, *shape), (*lead, *axes))

    out = [group("attn_norm.scale", (d,), ("embed",)),
           group("attn.wq", (d, h, hd), ("embed", "heads", "head_dim")),
           group("attn.wk", (d, kv, hd), ("embed", "kv_heads", "head_dim")),
           group("attn.wv", (d, kv, hd), ("embed", "kv_heads", "head_dim")),
           group("attn.wo", (h, hd, d), ("heads", "head_dim", "embed")),
           group("mlp_norm.scale", (d,), ("embed",))]
    if m.qkv_bias:
        out += [group("attn.bq", (h, hd), ("heads", "head_dim")), group("attn.bk", (kv, hd), ("kv_heads", "head_dim")),
                group("attn.bv", (kv, hd), ("kv_heads", "head_dim"))]
    if m.qk_norm:
        out += [group("attn.q_norm.scale", (hd,), ("head_dim",)), group("attn.k_norm.scale", (hd,), ("head_dim",))]
    if not moe:
        f = m.d_ff
        return [*out, group("mlp.w_gate", (d, f), ("embed", "mlp")), group("mlp.w_up", (d, f), ("embed", "mlp")),
                group("mlp.w_down", (f, d), ("mlp", "embed"))]
    e, f = m.moe.num_experts, m.resolved_moe_d_ff
    out += [group("mlp.router", (d, e), ("embed", "router_experts")),
            group("mlp.w_gate", (e, d, f), ("experts", "embed", "expert_mlp")),
            group("mlp.w_up", (e, d, f), ("experts", "embed", "expert_mlp")),
            group("mlp.w_down", (e, f, d), ("experts", "expert_mlp", "embed"))]
    if m.moe.num_shared_experts:
        shared = m.moe.num_shared_experts * f
        out += [group("mlp.shared_gate", (d, shared), ("embed", "mlp")),
                group("mlp.shared_up", (d, shared), ("embed", "mlp")),
                group("mlp.shared_down", (shared, d), ("mlp", "embed"))]
    return out

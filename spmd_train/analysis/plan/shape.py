"""The model as the planner sees it: every parameter's shape and logical axes, and the FLOPs per token.

`ModelShape.from_config` lists the parameters `models/transformer.py` creates, one `ParamGroup` per stacked
array, from the tables the model's modules create them from (`models.param_specs`), so the sharding arithmetic
over them is the engine's. FLOPs per token are `models.flops.flops_per_token`, not derived again.

Derivation: docs/explanation/planner-model.md#the-models-shape
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from spmd_train.config.field_types import DTYPE_BYTES
from spmd_train.config.mesh_schema import STACKING_AXES
from spmd_train.config.model_schema import ModelConfig
from spmd_train.config.precision_schema import takes_quantized
from spmd_train.models.flops import (
    attention_flops,
    layer_matmul_flops_per_token,
    layer_windows,
    matmul_params,
    moe_layer_count,
    window_counts,
)
from spmd_train.models.param_specs import model_params


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
    windows: tuple[tuple[int | None, int], ...]
    """(attention window, number of layers with it) per kind of layer (None: full causal attention)."""
    qkv_bias: bool = False
    """Biases on Q/K/V (model.qkv_bias)."""
    qk_norm: bool = False
    """Per-head RMSNorm scales on Q and K (model.qk_norm)."""
    v_head_dim: int | None = None
    """Per-head value width when it is not head_dim (MLA's v_head_dim; head_dim is then the query/key width)."""
    latent_width: int = 0
    """MLA: the width of what every tensor rank computes whole from the residual stream (the key/value latent, the
    shared rotated key and the query latent: kv_lora_rank + qk_rope_head_dim + q_lora_rank); 0 without MLA."""
    heads_read_residual: bool = True
    """A head-split projection reads the residual stream itself (grouped-query attention; MLA without a query
    latent), so its input gradient is a partial sum over `tensor`."""
    n_group: int = 1
    """Group-limited routing's expert groups (model.moe.n_group)."""
    topk_group: int = 1
    """The groups a token's experts come from (model.moe.topk_group)."""
    mtp_moe_layers: int = 0
    """MoE layers of the multi-token prediction modules (model.mtp.depth in an MoE model), after the trunk's."""
    mtp_depth: int = 0
    """Multi-token prediction modules (model.mtp.depth; 0 without): each one layer and one more pass of the head."""
    first_dense: int = 0
    """Dense layers before the layer stack (model.moe.first_k_dense), which a pipeline runs before its stages."""
    staged: tuple[tuple[float, int | None], ...] = ()
    """Each layer of the stack (the layers after first_dense), in model order: (training FLOPs per token of its
    matmuls, 6 x their parameters; its attention window, None for full causal attention)."""
    stack_unit: int = 1
    """Layers per row of the stack (model.moe.every for MoE groups): pipeline chunks hold whole rows."""

    @classmethod
    def from_config(cls, m: ModelConfig) -> ModelShape:
        """The shape of the model `m` describes, parameter by parameter as `Transformer` builds it."""
        moe = m.moe
        return cls(
            num_layers=m.num_layers, d_model=m.d_model, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
            head_dim=m.resolved_head_dim, d_ff=m.d_ff, vocab_size=m.vocab_size, tie_embeddings=m.tie_embeddings,
            moe_layers=moe_layer_count(m), num_experts=moe.num_experts if moe else 0,
            experts_per_token=moe.experts_per_token if moe else 0, moe_d_ff=m.resolved_moe_d_ff,
            num_shared_experts=moe.num_shared_experts if moe else 0,
            param_bytes=DTYPE_BYTES[m.param_dtype], compute_bytes=DTYPE_BYTES[m.compute_dtype],
            params=_param_groups(m), matmul_params=matmul_params(m),
            windows=window_counts(m), qkv_bias=m.qkv_bias,
            qk_norm=m.qk_norm, v_head_dim=m.resolved_v_head_dim if m.mla is not None else None,
            latent_width=0 if m.mla is None else m.mla.kv_lora_rank + m.mla.qk_rope_head_dim + (m.mla.q_lora_rank or 0),
            heads_read_residual=m.mla is None or m.mla.q_lora_rank is None,
            n_group=moe.n_group if moe else 1, topk_group=moe.topk_group if moe else 1,
            mtp_moe_layers=m.mtp.depth if m.mtp is not None and moe else 0,
            mtp_depth=m.mtp.depth if m.mtp is not None else 0, first_dense=m.first_dense,
            staged=_staged_layers(m), stack_unit=max(m.moe_every, 1),
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
        """Parameters of one dense layer (norms, attention, SwiGLU MLP); 0 when every layer is MoE."""
        if self.moe_layers == 0:
            return _per_layer(self.params, "blocks")
        # MoE groups' dense layers, else model.moe.first_k_dense's (every layer after them MoE)
        grouped = any(g.path.startswith("blocks.dense.") for g in self.params)
        return _per_layer(self.params, "blocks.dense" if grouped else "first_blocks")

    @property
    def moe_layer_params(self) -> int:
        """Parameters of one MoE layer: a dense layer's, with the router and experts in place of the MLP."""
        if self.moe_layers == 0:
            return 0
        grouped = any(g.path.startswith("blocks.moe.") for g in self.params)
        return _per_layer(self.params, "blocks.moe" if grouped else "blocks")

    @property
    def routed_expert_params(self) -> int:
        """Routed-expert parameters a token uses across the trunk's MoE layers (k experts' three matrices each)."""
        return 3 * self.d_model * self.moe_d_ff * self.experts_per_token * self.moe_layers

    def quantized_params(self) -> int:
        """Parameters whose matmuls precision.matmul=fp8|int8 quantizes (`config.precision_schema.takes_quantized`):
        each is used once per token, as every dense layer's weights are."""
        return sum(g.numel for g in self.params if takes_quantized(g.axes))

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
        return 6.0 * self.matmul_params + self.attention_flops_per_token(seq_len)

    def staged_flops_per_token(self, seq_len: int) -> list[float]:
        """Training FLOPs per token of each layer of the stack at this context length (`models.flops`'
        `layer_flops_per_token` of the layers after first_dense)."""
        return [matmul + attention_flops(self.num_heads, self.head_dim, window, seq_len, self.v_head_dim)
                for matmul, window in self.staged]

    @property
    def head_flops_per_token(self) -> float:
        """Training FLOPs per token of the LM head (`models.flops.head_flops_per_token`)."""
        return 6.0 * self.d_model * self.vocab_size

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of every layer's scores and weighted values (`models.flops.attention_flops`)."""
        return sum(count * attention_flops(self.num_heads, self.head_dim, w, seq_len, self.v_head_dim)
                   for w, count in self.windows)


def _staged_layers(m: ModelConfig) -> tuple[tuple[float, int | None], ...]:
    """(6 x matmul parameters, attention window) of each layer after the first_dense ones, in model order."""
    layers = zip(layer_matmul_flops_per_token(m), layer_windows(m), strict=True)
    return tuple(layers)[m.first_dense:]


def _param_groups(m: ModelConfig) -> tuple[ParamGroup, ...]:
    """The parameters `Transformer(m)` creates (`models.param_specs.model_params`)."""
    return tuple(ParamGroup(path, shape, axes, lookup_only=path == "embedding" and not m.tie_embeddings)
                 for path, shape, axes in model_params(m))


def _per_layer(groups: tuple[ParamGroup, ...], prefix: str) -> int:
    """Parameters of one layer of the stack whose paths start with `prefix`."""
    total = 0
    for g in groups:
        if g.path.startswith(prefix + "."):
            stacked = math.prod(n for n, a in zip(g.shape, g.axes, strict=True) if a in STACKING_AXES)
            total += g.numel // stacked
    return total

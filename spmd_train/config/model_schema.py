"""The `model` and `backends` sections: the architecture, and which implementation computes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import AfterValidator

from spmd_train.config.attention_facts import attention_names
from spmd_train.config.field_types import (
    STRICT,
    DType,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
)

AttentionImpl = Literal[("auto", *attention_names())]
"""backends.attention's values: auto and the implementations `config.attention_facts` registers."""
MoEImpl = Literal["capacity", "capacity_dedup", "dropless"]
MLPActivation = Literal["silu", "gelu_tanh"]
"""The gated MLP's gate activation: silu (SwiGLU) or tanh-approximated GELU (GeGLU)."""
LayerType = Literal["full", "sliding"]
"""A layer's attention: over every earlier token (full) or over the model.sliding_window latest (sliding)."""


def _check_blocks(blocks: tuple[int, int] | None) -> tuple[int, int] | None:
    if blocks is not None and any(b < 8 or b % 8 for b in blocks):
        raise ValueError("block_q and block_k must be positive multiples of 8 (e.g. [512, 512] on TPU, "
                         "[128, 128] on GPU)")
    return blocks


Blocks = Annotated[tuple[int, int] | None, AfterValidator(_check_blocks)]


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts: which layers route each token to k of E SwiGLU experts, and the router's losses."""

    __pydantic_config__ = STRICT

    every: PositiveInt = 1
    """Every k-th layer's MLP is an MoE layer (1: all of them), counted after the first_k_dense dense layers; must
    divide the layers after them."""
    first_k_dense: NonNegativeInt = 0
    """The first this many layers are dense (SwiGLU of model.d_ff) before the MoE pattern starts (DeepSeek-V3: 3);
    fewer than model.num_layers."""
    num_experts: PositiveInt = 8
    """Routed experts per MoE layer (split over mesh.expert)."""
    experts_per_token: PositiveInt = 2
    """Top-k: experts each token is sent to (at most num_experts)."""
    d_ff: PositiveInt | None = None
    """Hidden width of each expert's SwiGLU; defaults to model.d_ff."""
    num_shared_experts: NonNegativeInt = 0
    """Experts every token goes through (one SwiGLU of width num_shared_experts x d_ff)."""
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    """How router logits become expert scores before top-k (DeepSeek-V3: sigmoid)."""
    norm_topk_prob: bool = True
    """Renormalise each token's k gates to sum to 1 (Mixtral, Qwen3-MoE, DeepSeek-V3); false: the gates are the
    chosen experts' scores as they are (DeepSeek-V2)."""
    routed_scaling_factor: PositiveFloat = 1.0
    """The routed experts' gates are multiplied by this, after any renormalisation (DeepSeek-V3: 2.5)."""
    n_group: PositiveInt = 1
    """Group-limited routing: the experts form n_group equal groups of consecutive experts (DeepSeek-V3: 8)."""
    topk_group: PositiveInt = 1
    """Group-limited routing: each token picks its experts from its topk_group best groups, ranked as group_score
    says (DeepSeek-V3: 4, DeepSeek-V2: 3; equal to n_group: no limit)."""
    group_score: Literal["top2_sum", "max"] = "top2_sum"
    """How group-limited routing ranks a group: the sum of its two best (selection-biased) scores (DeepSeek-V3's
    noaux_tc), or its best score (DeepSeek-V2's group_limited_greedy)."""
    bias_update_rate: NonNegativeFloat | None = None
    """Auxiliary-loss-free balancing (DeepSeek-V3: 0.001): each MoE layer gets a per-expert bias added to the scores
    for selection only, moved by this rate times the sign of (mean load - the expert's load) after every step; 0:
    the bias kept as it is (DeepSeek-V3's last 500B tokens); null: no bias. A resume may change the rate."""
    seq_aux_weight: NonNegativeFloat = 0.0
    """Weight of DeepSeek-V3's sequence-wise balance loss (1 when each sequence is balanced; DeepSeek-V3: 0.0001)."""
    router_logit_bias: bool = False
    """A learned bias on the router logits, trained like any parameter (gpt-oss)."""
    expert_bias: bool = False
    """Biases on each routed expert's gate, up and down projections (gpt-oss)."""
    swiglu_limit: PositiveFloat | None = None
    """gpt-oss's clamped SwiGLU in the routed experts: the gate clamped to at most this and the up projection to
    [-this, this], then (up + 1) * gate * sigmoid(1.702 * gate) (gpt-oss: 7.0); null: SwiGLU, silu(gate) * up."""
    router_aux_weight: NonNegativeFloat = 0.01
    """Weight of the load-balancing loss (Switch/GShard) in the training loss."""
    router_z_weight: NonNegativeFloat = 0.001
    """Weight of the router z-loss (mean squared logsumexp of router logits)."""


    @property
    def router_bias(self) -> bool:
        """Whether each MoE layer holds a selection bias (auxiliary-loss-free balancing; moving or frozen)."""
        return self.bias_update_rate is not None

    @property
    def moves_bias(self) -> bool:
        """Whether the train step moves the selection biases (a positive bias_update_rate)."""
        return bool(self.bias_update_rate)


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): keys and values expanded per head from one low-rank
    latent per token, plus one RoPE key shared by every head; the names are DeepSeek's config.json keys."""

    __pydantic_config__ = STRICT

    kv_lora_rank: PositiveInt
    """Width of the compressed key/value latent of each token (DeepSeek-V2/V3: 512)."""
    qk_nope_head_dim: PositiveInt
    """Per-head width of the query and key parts without RoPE, expanded from the latents (DeepSeek-V3: 128)."""
    qk_rope_head_dim: PositiveInt
    """Per-head width of the rotated query part; the rotated key of this width is one per token, shared by every
    head (DeepSeek-V3: 64; even)."""
    v_head_dim: PositiveInt
    """Per-head value width, expanded from the key/value latent (DeepSeek-V3: 128)."""
    q_lora_rank: PositiveInt | None = None
    """Width of the compressed query latent (DeepSeek-V3: 1536); null: queries projected from the residual stream
    directly (DeepSeek-V2-Lite)."""


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequencies stretched for long context: Llama 3.1's per-band rule, plain linear interpolation, or YaRN
    (Qwen2.5/3, DeepSeek-V3, gpt-oss; arXiv:2309.00071, as `transformers` computes it)."""

    __pydantic_config__ = STRICT

    type: Literal["llama3", "linear", "yarn"]
    """llama3: long wavelengths divided by `factor`, short ones kept, a smooth ramp between; linear: all divided;
    yarn: frequencies between beta_slow and beta_fast rotations over original_max_position ramped from kept to
    divided, and cos/sin times an attention factor."""
    factor: PositiveFloat
    low_freq_factor: PositiveFloat = 1.0
    """llama3: wavelengths above original_max_position / low_freq_factor are scaled fully."""
    high_freq_factor: PositiveFloat = 4.0
    """llama3: wavelengths below original_max_position / high_freq_factor are kept."""
    original_max_position: PositiveInt = 8192
    """llama3 and yarn: the context length the model was first trained at."""
    beta_fast: PositiveFloat = 32.0
    """yarn: frequencies that turn more than this many times over original_max_position are kept."""
    beta_slow: PositiveFloat = 1.0
    """yarn: frequencies that turn fewer than this many times over original_max_position are divided by factor."""
    mscale: PositiveFloat | None = None
    """yarn: with mscale_all_dim, the attention factor is (0.1 mscale ln factor + 1) / (0.1 mscale_all_dim ln factor
    + 1) (DeepSeek-V3: 1.0 and 1.0); else 0.1 ln factor + 1. With model.mla, mscale_all_dim also multiplies the
    softmax scale by (0.1 mscale_all_dim ln factor + 1) squared, as DeepSeek's attention does."""
    mscale_all_dim: PositiveFloat | None = None
    """yarn: see mscale."""
    attention_factor: PositiveFloat | None = None
    """yarn: cos and sin are multiplied by this; null: from factor (and mscale, mscale_all_dim) as above."""
    truncate: bool = True
    """yarn: the ramp's ends rounded out to whole dimensions (gpt-oss: false)."""


@dataclass(frozen=True)
class MTPConfig:
    """Multi-token prediction (DeepSeek-V3 report, section 2.2): `depth` modules after the trunk, the k-th predicting
    the token k + 1 places ahead from the previous depth's hidden state and the embedding of the token k places
    ahead, through the model's own embedding and LM head. A training signal only: generation and export leave it."""

    __pydantic_config__ = STRICT

    depth: PositiveInt = 1
    """Modules, each one transformer layer of the model's kind (an MoE layer in an MoE model; DeepSeek-V3: 1)."""
    loss_weight: PositiveFloat = 0.3
    """lambda: the mean of the modules' cross-entropies joins the loss times this (DeepSeek-V3: 0.3 for its first
    10T tokens, then 0.1)."""


@dataclass(frozen=True)
class ModelConfig:
    """The model: a decoder-only transformer (Llama-style), optionally with MoE layers.

    This section is the architecture: a checkpoint resumes only into the same section (how it is
    computed, the attention and expert implementations, is the `backends` section).
    """

    __pydantic_config__ = STRICT

    preset: str | None = None
    num_layers: PositiveInt = 2
    d_model: PositiveInt = 64
    num_heads: PositiveInt = 8
    num_kv_heads: PositiveInt = 4
    head_dim: PositiveInt | None = None
    d_ff: PositiveInt = 128
    vocab_size: PositiveInt = 256
    rope_theta: PositiveFloat = 10000.0
    rope_scaling: RopeScaling | None = None
    """Stretched rotary frequencies (Llama 3.1/3.2); null: plain RoPE."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2)."""
    attn_output_bias: bool = False
    """A bias on the attention output projection (gpt-oss, with qkv_bias: its attention_bias)."""
    qk_norm: bool = False
    """RMSNorm over each head's query and key before RoPE (Qwen3)."""
    sliding_window: PositiveInt | None = None
    """Keys a sliding layer's query sees: itself and the window - 1 before it (Mistral 4096, Gemma 3 1024, gpt-oss
    128); which layers slide is `layer_types`."""
    layer_types: tuple[LayerType, ...] = ()
    """Each layer's attention, the list repeated over the layers when shorter: [sliding, sliding, sliding, sliding,
    sliding, full] is Gemma 3's 5:1, [sliding, full] gpt-oss's alternation; empty: every layer sliding when
    sliding_window is set (Mistral), else full."""
    rope_local_theta: PositiveFloat | None = None
    """RoPE base of the sliding layers, which then take no rope_scaling (Gemma 3: 10000); null: the same RoPE as the
    full layers."""
    attention_sinks: bool = False
    """A learned logit per query head that joins every softmax denominator and takes no value (gpt-oss)."""
    attn_logit_softcap: PositiveFloat | None = None
    """Attention logits become cap * tanh(logits / cap) (Gemma 2: 50); null: uncapped."""
    final_logit_softcap: PositiveFloat | None = None
    """Output logits become cap * tanh(logits / cap) (Gemma 2: 30); null: uncapped."""
    query_pre_attn_scalar: PositiveFloat | None = None
    """Attention logits are scaled by 1 / sqrt(this) instead of 1 / sqrt(head_dim) (Gemma 2 27B: 144)."""
    norm_eps: NonNegativeFloat = 1e-5
    norm_plus_one: bool = False
    """Every RMSNorm multiplies by (1 + scale), its scale stored and initialised at zero (Gemma); false: by scale,
    initialised at one."""
    sandwich_norms: bool = False
    """An RMSNorm on the attention output and one on the MLP output, each before its residual add, besides the
    norms on their inputs (Gemma 2/3)."""
    scale_embeddings: bool = False
    """The embedded tokens are multiplied by sqrt(d_model), rounded to the compute dtype (Gemma)."""
    mlp_activation: MLPActivation = "silu"
    """The dense MLP's gate activation: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma; dense models only)."""
    tie_embeddings: bool = False
    init_std: PositiveFloat = 0.02
    compute_dtype: DType = "float32"
    param_dtype: DType = "float32"
    moe: MoEConfig | None = None
    """Mixture-of-experts layers; null: a dense model."""
    mla: MLAConfig | None = None
    """Multi-head latent attention in every layer (then num_kv_heads = num_heads, head_dim null); null: grouped-query
    attention."""
    mtp: MTPConfig | None = None
    """Multi-token prediction modules trained beside the next-token head; null: none."""

    @property
    def resolved_head_dim(self) -> int:
        """Per-head width of queries and keys: `head_dim` when set, else d_model // num_heads; with MLA
        qk_nope_head_dim + qk_rope_head_dim."""
        if self.mla is not None:
            return self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    @property
    def resolved_v_head_dim(self) -> int:
        """Per-head width of values: the query/key width, or MLA's v_head_dim."""
        return self.mla.v_head_dim if self.mla is not None else self.resolved_head_dim

    @property
    def rope_head_dim(self) -> int:
        """Per-head width RoPE rotates: the whole query/key head, or MLA's qk_rope_head_dim."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.resolved_head_dim

    @property
    def layer_pattern(self) -> tuple[str, ...]:
        """The attention kinds the layers repeat: `layer_types`, or its default (one kind for every layer)."""
        return self.layer_types or (("sliding",) if self.sliding_window is not None else ("full",))

    @property
    def attention_kinds(self) -> frozenset[str]:
        """The kinds some layer has, from the pattern alone (cheap whatever num_layers is)."""
        return frozenset(self.layer_pattern[: self.num_layers])

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's attention, "full" or "sliding" (`layer_types` repeated over the layers, or its default).

        One entry per layer: for building the model, not for checks that run before num_layers is known sane."""
        pattern = self.layer_pattern
        return tuple(pattern[i % len(pattern)] for i in range(self.num_layers))

    def window_of(self, kind: str) -> int | None:
        """The keys a query of a `kind` layer sees at most (None: every earlier one)."""
        return self.sliding_window if kind == "sliding" else None

    @property
    def moe_every(self) -> int:
        """Every how many layers an MoE layer comes (0: a dense model)."""
        return self.moe.every if self.moe is not None else 0

    @property
    def first_dense(self) -> int:
        """Dense layers before the MoE pattern (model.moe.first_k_dense; 0 without MoE): a stack of their own."""
        return self.moe.first_k_dense if self.moe is not None else 0

    @property
    def stack_rows(self) -> int:
        """Rows of the stacked layer parameters (`blocks`, after the first_dense layers): one per layer, or per MoE
        group (every > 1 layers ending in MoE)."""
        layers = self.num_layers - self.first_dense
        return layers // self.moe_every if self.moe_every > 1 else layers

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i (from 0) is an MoE layer: every moe.every-th layer after the first_dense ones."""
        every, first = self.moe_every, self.first_dense
        return every > 0 and i >= first and (i - first + 1) % every == 0

    @property
    def resolved_moe_d_ff(self) -> int:
        """Per-expert hidden width: `moe.d_ff` when set, else d_ff."""
        return self.moe.d_ff if self.moe is not None and self.moe.d_ff is not None else self.d_ff


@dataclass(frozen=True)
class BackendsConfig:
    """Which implementation computes attention and the experts; resolved once per run (`parallel.Backends`)."""

    __pydantic_config__ = STRICT

    attention: AttentionImpl = "auto"
    """auto: Pallas kernel on TPU, cuDNN on GPU, plain XLA on CPU (where Pallas runs only in interpret mode)."""
    attention_blocks: Blocks = None
    """(block_q, block_k) of the Pallas kernels; None: per-backend defaults (TPU 512 x 512, GPU 128 x 128)."""
    moe: MoEImpl = "capacity"
    """capacity: fixed slots per expert, overflow dropped (all-to-all); capacity_dedup: each token sent once to each
    expert-axis device holding its experts, fixed rows per device (fewer bytes under group-limited routing);
    dropless: ragged all-to-all (GPU/TPU only)."""
    capacity_factor: PositiveFloat = 1.25
    """moe=capacity: slots per expert = ceil(k x tokens per group x capacity_factor / num_experts); capacity_dedup:
    rows per device = ceil(devices reached x tokens per group x capacity_factor / mesh.expert) (docs/moe.md)."""

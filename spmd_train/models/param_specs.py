"""Every parameter the model has: its shape and logical axes, per module and for the whole tree. Pure Python (no jax).

The NNX modules (`models/transformer.py`, `models/moe.py`) create their parameters from these tables, and the
planner (`analysis.plan.shape.ModelShape`) lists them from the same tables before jax starts: a new parameter is
declared here once.
"""

from __future__ import annotations

from spmd_train.config.mesh_schema import STACKING_AXES
from spmd_train.config.model_schema import ModelConfig

Spec = tuple[tuple[int, ...], tuple[str, ...]]
"""(shape, logical axes) of one parameter, unstacked."""

def in_layer_stack(path) -> bool:
    """Whether a parameter's tree path (jax key path) is under `blocks`, the layer stack whose arrays stack the layers
    on axis 0."""
    return any(getattr(k, "key", None) == "blocks" for k in path)


EXPERT_GATE_UP_AXES = ("experts", "embed", "expert_mlp")
EXPERT_DOWN_AXES = ("experts", "expert_mlp", "embed")
EXPERT_BIAS_UP_AXES = ("experts", "expert_mlp")
EXPERT_BIAS_DOWN_AXES = ("experts", "embed")


def norm_params(cfg: ModelConfig, axis: str = "embed") -> dict[str, Spec]:
    """An RMSNorm's scale over the residual stream (`embed`), each head (`head_dim`, Qwen3's q/k norms) or one of
    MLA's latents (`q_lora`, `kv_lora`)."""
    sizes = {"embed": cfg.d_model, "head_dim": cfg.resolved_head_dim}
    if cfg.mla is not None:
        sizes |= {"q_lora": cfg.mla.q_lora_rank, "kv_lora": cfg.mla.kv_lora_rank}
    return {"scale": ((sizes[axis],), (axis,))}


def attention_params(cfg: ModelConfig) -> dict[str, Spec]:
    """Grouped-query attention's projections (Qwen2's biases, gpt-oss's output bias and per-head sink logits); its
    q/k norms are `norm_params(cfg, "head_dim")`."""
    d, hd, h, kv = cfg.d_model, cfg.resolved_head_dim, cfg.num_heads, cfg.num_kv_heads
    out = {"wq": ((d, h, hd), ("embed", "heads", "head_dim")), "wk": ((d, kv, hd), ("embed", "kv_heads", "head_dim")),
           "wv": ((d, kv, hd), ("embed", "kv_heads", "head_dim")), "wo": ((h, hd, d), ("heads", "head_dim", "embed"))}
    if cfg.attention_sinks:
        out["sinks"] = ((h,), ("heads",))
    if cfg.qkv_bias:
        out |= {"bq": ((h, hd), ("heads", "head_dim")), "bk": ((kv, hd), ("kv_heads", "head_dim")),
                "bv": ((kv, hd), ("kv_heads", "head_dim"))}
    if cfg.attn_output_bias:
        out["bo"] = ((d,), ("embed",))
    return out


def mla_params(cfg: ModelConfig) -> dict[str, Spec]:
    """Multi-head latent attention's projections (DeepSeek-V2's layout), its latent norms and optional sinks.

    wq_a and wq_b (or wq without a query latent) give each head's query, nope then rope part; wkv_a gives the
    key/value latent and, in its last qk_rope_head_dim columns, the one rotated key every head shares; wkv_b expands
    the normalised latent into each head's key (nope part) and value. The expansions' latent rows are `q_lora_in` and
    `kv_lora_in`, not the latents' own names: ZeRO splits them (as it splits `embed`) while the latent activations,
    and wq_a and wkv_a, whose `embed` the ZeRO axes already split, keep `q_lora` and `kv_lora` unsplit."""
    a, d, h = cfg.mla, cfg.d_model, cfg.num_heads
    qk, nope, v = cfg.resolved_head_dim, a.qk_nope_head_dim, a.v_head_dim
    out: dict[str, Spec] = {}
    if a.q_lora_rank is None:
        out["wq"] = ((d, h, qk), ("embed", "heads", "head_dim"))
    else:
        out |= {"wq_a": ((d, a.q_lora_rank), ("embed", "q_lora")), "q_norm.scale": norm_params(cfg, "q_lora")["scale"],
                "wq_b": ((a.q_lora_rank, h, qk), ("q_lora_in", "heads", "head_dim"))}
    out |= {"wkv_a": ((d, a.kv_lora_rank + a.qk_rope_head_dim), ("embed", "kv_lora")),
            "kv_norm.scale": norm_params(cfg, "kv_lora")["scale"],
            "wkv_b": ((a.kv_lora_rank, h, nope + v), ("kv_lora_in", "heads", "head_dim")),
            "wo": ((h, v, d), ("heads", "head_dim", "embed"))}
    if cfg.attention_sinks:
        out["sinks"] = ((h,), ("heads",))
    return out


def mlp_params(cfg: ModelConfig) -> dict[str, Spec]:
    """The dense gated feed-forward (SwiGLU, or GeGLU with model.mlp_activation=gelu_tanh)."""
    d, f = cfg.d_model, cfg.d_ff
    return {"w_gate": ((d, f), ("embed", "mlp")), "w_up": ((d, f), ("embed", "mlp")),
            "w_down": ((f, d), ("mlp", "embed"))}


def moe_params(cfg: ModelConfig) -> dict[str, Spec]:
    """The router, the routed experts and the shared experts (as one wider SwiGLU) of an MoE feed-forward."""
    d, f, e = cfg.d_model, cfg.resolved_moe_d_ff, cfg.moe.num_experts
    out = {"router": ((d, e), ("embed", "router_experts")), "w_gate": ((e, d, f), EXPERT_GATE_UP_AXES),
           "w_up": ((e, d, f), EXPERT_GATE_UP_AXES), "w_down": ((e, f, d), EXPERT_DOWN_AXES)}
    if cfg.moe.router_bias:  # auxiliary-loss-free balancing's selection bias: state, never trained
        out["router_bias"] = ((e,), ("router_experts",))
    if cfg.moe.router_logit_bias:
        out["router_logit_bias"] = ((e,), ("router_experts",))
    if cfg.moe.expert_bias:
        out |= {"b_gate": ((e, f), EXPERT_BIAS_UP_AXES), "b_up": ((e, f), EXPERT_BIAS_UP_AXES),
                "b_down": ((e, d), EXPERT_BIAS_DOWN_AXES)}
    if cfg.moe.num_shared_experts:
        shared = cfg.moe.num_shared_experts * f
        out |= {"shared_gate": ((d, shared), ("embed", "mlp")), "shared_up": ((d, shared), ("embed", "mlp")),
                "shared_down": ((shared, d), ("mlp", "embed"))}
    return out


def table_params(cfg: ModelConfig) -> dict[str, Spec]:
    """The vocabulary tables: the embedding, and the LM head when it is not tied to it."""
    d, v = cfg.d_model, cfg.vocab_size
    out = {"embedding": ((v, d), ("vocab", "embed"))}
    if not cfg.tie_embeddings:
        out["lm_head"] = ((d, v), ("embed", "vocab"))
    return out


def block_params(cfg: ModelConfig, *, moe: bool) -> dict[str, Spec]:
    """One layer (`Block`): its two norms (four with model.sandwich_norms), attention and a dense or MoE feed-forward,
    by dot-joined path."""
    norms = ("attn_norm", "mlp_norm") + (("attn_post_norm", "mlp_post_norm") if cfg.sandwich_norms else ())
    out = {f"{n}.scale": norm_params(cfg)["scale"] for n in norms}
    out |= {f"attn.{k}": v for k, v in (mla_params(cfg) if cfg.mla else attention_params(cfg)).items()}
    if cfg.qk_norm:
        out |= {f"attn.{n}.scale": norm_params(cfg, "head_dim")["scale"] for n in ("q_norm", "k_norm")}
    out |= {f"mlp.{k}": v for k, v in (moe_params(cfg) if moe else mlp_params(cfg)).items()}
    return out


def mtp_params(cfg: ModelConfig) -> dict[str, Spec]:
    """One multi-token prediction module (`models.mtp.MTP`): norms on the embedded next tokens and on the previous
    depth's hidden state, the projection of the two (concatenated, embedding first) back to d_model, one layer of the
    model's kind, and the norm before the shared LM head."""
    d = cfg.d_model
    out = {f"{n}.scale": norm_params(cfg)["scale"] for n in ("embed_norm", "hidden_norm", "head_norm")}
    out["eh_proj"] = ((2 * d, d), ("embed", "mlp"))
    out |= {f"block.{k}": v for k, v in block_params(cfg, moe=cfg.moe_every > 0).items()}
    return out


def model_params(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], tuple[str, ...]]]:
    """(dot-joined path, shape, logical axes) of every array `Transformer(cfg)` creates, the layer stacks' leading
    `layers` (and `sublayers`) dimensions included: the tables, then the layer stack(s), then the final norm, then any
    multi-token prediction modules (stacked on `layers`, one row per depth)."""
    tables = table_params(cfg)
    out = [("embedding", *tables["embedding"])]
    every, first = cfg.moe_every, cfg.first_dense
    layers = cfg.num_layers - first
    if first:  # model.moe.first_k_dense: the dense layers before the MoE pattern, a stack of their own
        out += _stacked(block_params(cfg, moe=False), "first_blocks", (first,), ("first_layers",))
    if every in (0, 1):
        out += _stacked(block_params(cfg, moe=every == 1), "blocks", (layers,))
    else:
        out += _stacked(block_params(cfg, moe=False), "blocks.dense", (layers // every, every - 1))
        out += _stacked(block_params(cfg, moe=True), "blocks.moe", (layers // every,))
    out.append(("final_norm.scale", *norm_params(cfg)["scale"]))
    if "lm_head" in tables:
        out.append(("lm_head", *tables["lm_head"]))
    if cfg.mtp is not None:
        out += _stacked(mtp_params(cfg), "mtp", (cfg.mtp.depth,))
    return out


def _stacked(specs: dict[str, Spec], prefix: str, stack: tuple[int, ...], lead: tuple[str, ...] | None = None) -> list:
    lead = STACKING_AXES[: len(stack)] if lead is None else lead
    return [(f"{prefix}.{path}", (*stack, *shape), (*lead, *axes)) for path, (shape, axes) in specs.items()]

"""Decoder-only Llama-style transformer in Flax NNX.

RMSNorm, rotary embeddings (optionally Llama 3.1-scaled), SwiGLU MLP, grouped-query attention (optionally
with Q/K/V biases as in Qwen2, or per-head Q/K norms as in Qwen3), tied or untied embeddings.
The layers' parameters are stacked on a leading `layers` axis and run with `lax.scan`, so
compile time does not grow with depth. The model speaks logical axis names only
(`constrain`); which mesh axes they land on is decided outside.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from spmd_train.config.model_schema import BackendsConfig, ModelConfig
from spmd_train.models.layers import Pinned, dense, param, pin, weight
from spmd_train.models.moe import MoE
from spmd_train.models.padded_row import padded_row
from spmd_train.models.param_specs import attention_params, mlp_params, norm_params, table_params
from spmd_train.models.remat import apply_remat
from spmd_train.ops.rope import apply_rope, rope_tables
from spmd_train.parallel import Backends, attention, resolve_backends
from spmd_train.sharding.constrain import constrain

RESIDUAL = ("batch", "norm_length", "embed")


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis with a learned scale; statistics in fp32.

    The residual stream's norms span `embed`; Qwen3's query/key norms span each head's `head_dim`.
    """

    def __init__(self, cfg: ModelConfig, *, stack: int | None = None, axis: str = "embed"):
        self.eps = cfg.norm_eps
        self.scale = param(None, *norm_params(cfg, axis)["scale"], std=None, dtype=cfg.param_dtype, stack=stack)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * weight(self.scale, jnp.float32)).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query self-attention; Q/K/V column-parallel and the output row-parallel over heads."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, backends: Backends, *, stack: int | None = None):
        out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
        kw = {"dtype": cfg.param_dtype, "stack": stack}
        specs = attention_params(cfg)
        self.wq = param(rngs.params(), *specs["wq"], std=cfg.init_std, **kw)
        self.wk = param(rngs.params(), *specs["wk"], std=cfg.init_std, **kw)
        self.wv = param(rngs.params(), *specs["wv"], std=cfg.init_std, **kw)
        self.wo = param(rngs.params(), *specs["wo"], std=out_std, **kw)
        if cfg.qkv_bias:
            self.bq = param(None, *specs["bq"], std=0.0, **kw)
            self.bk = param(None, *specs["bk"], std=0.0, **kw)
            self.bv = param(None, *specs["bv"], std=0.0, **kw)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg, stack=stack, axis="head_dim")
            self.k_norm = RMSNorm(cfg, stack=stack, axis="head_dim")
        self.qkv_bias, self.qk_norm = cfg.qkv_bias, cfg.qk_norm
        self.compute_dtype = cfg.compute_dtype
        self.backends = backends

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segments: jax.Array | None = None) -> jax.Array:
        q, k, v = self.project(x, cos, sin)
        out = attention(q, k, v, backends=self.backends, segments=segments)
        return self.output(out)

    def project(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The residual stream -> queries, keys (both rotated) and values, [batch, length, heads, head_dim]."""
        dt = self.compute_dtype
        q = dense("bld,dhk->blhk", x, self.wq, dt)
        k = dense("bld,dhk->blhk", x, self.wk, dt)
        v = dense("bld,dhk->blhk", x, self.wv, dt)
        if self.qkv_bias:
            q, k, v = q + weight(self.bq, dt), k + weight(self.bk, dt), v + weight(self.bv, dt)
        q = constrain(q, ("batch", "length", "heads", "head_dim"))
        k = constrain(k, ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def output(self, out: jax.Array) -> jax.Array:
        """The heads' attention output [batch, length, heads, head_dim] -> the residual stream's update."""
        out = constrain(out, ("batch", "length", "heads", "head_dim"))
        return constrain(dense("blhk,hkd->bld", out, self.wo, self.compute_dtype), RESIDUAL)


class MLP(nnx.Module):
    """SwiGLU feed-forward; gate/up column-parallel, down row-parallel over `mlp`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *, stack: int | None = None):
        out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
        kw = {"dtype": cfg.param_dtype, "stack": stack}
        specs = mlp_params(cfg)
        self.w_gate = param(rngs.params(), *specs["w_gate"], std=cfg.init_std, **kw)
        self.w_up = param(rngs.params(), *specs["w_up"], std=cfg.init_std, **kw)
        self.w_down = param(rngs.params(), *specs["w_down"], std=out_std, **kw)
        self.compute_dtype = cfg.compute_dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.compute_dtype
        gate = constrain(dense("bld,df->blf", x, self.w_gate, dt), ("batch", "length", "mlp"))
        up = constrain(dense("bld,df->blf", x, self.w_up, dt), ("batch", "length", "mlp"))
        hidden = jax.nn.silu(gate) * up
        return constrain(dense("blf,fd->bld", hidden, self.w_down, dt), RESIDUAL)


class Block(nnx.Module):
    """Pre-norm transformer layer: x + attn(norm(x)), then + mlp(norm(x)); the MLP may be an MoE layer.

    Returns (x, stats): the MoE layer's router statistics, or an empty dict. `segments` [batch, length]:
    each token's document, when attention must stay inside documents.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, backends: Backends, *, stack=None, moe: bool = False):
        self.attn_norm = RMSNorm(cfg, stack=stack)
        self.attn = Attention(cfg, rngs, backends, stack=stack)
        self.mlp_norm = RMSNorm(cfg, stack=stack)
        self.mlp = MoE(cfg, rngs, backends, stack=stack) if moe else MLP(cfg, rngs, stack=stack)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
                 segments: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        with jax.named_scope("attention"):
            x = x + self.attn(constrain(self.attn_norm(x), RESIDUAL), cos, sin, segments)
        with jax.named_scope("mlp"):
            out = self.mlp(constrain(self.mlp_norm(x), RESIDUAL))
        out, stats = out if isinstance(out, tuple) else (out, {})
        return constrain(x + out, RESIDUAL), stats


class MoEGroup(nnx.Module):
    """model.moe.every = k > 1: k - 1 dense layers (stacked on `sublayers`), then one MoE layer."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, backends: Backends, *, stack: int):
        self.dense = Block(cfg, rngs, backends, stack=(stack, cfg.moe_every - 1))
        self.moe = Block(cfg, rngs, backends, stack=stack, moe=True)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
                 segments: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        graphdef, stacked = nnx.split(self.dense)
        x, _ = jax.lax.scan(lambda c, p: (nnx.merge(graphdef, p)(c, cos, sin, segments)[0], None), x, stacked)
        return self.moe(x, cos, sin, segments)


def make_blocks(cfg: ModelConfig, rngs: nnx.Rngs, backends: Backends) -> nnx.Module:
    """The layer stack: L dense layers, L MoE layers (model.moe.every=1), or L/k groups ending in an MoE layer."""
    k = cfg.moe_every
    if k == 0:
        return Block(cfg, rngs, backends, stack=cfg.num_layers)
    if k == 1:
        return Block(cfg, rngs, backends, stack=cfg.num_layers, moe=True)
    return MoEGroup(cfg, rngs, backends, stack=cfg.num_layers // k)


class Transformer(nnx.Module):
    """The decoder: tokens [batch, length] -> logits [batch, length, vocab] in the compute dtype.

    `backends` is the engine's choice of implementations; built alone, the model resolves them for
    the default jax platform (without per-device shapes).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, backends: Backends | None = None):
        self.cfg = cfg
        backends = backends or resolve_backends(cfg, BackendsConfig(), jax.default_backend())
        tables = table_params(cfg)
        self.embedding = param(rngs.params(), *tables["embedding"], std=cfg.init_std, dtype=cfg.param_dtype)
        self.blocks = make_blocks(cfg, rngs, backends)
        self.final_norm = RMSNorm(cfg)
        if "lm_head" in tables:
            self.lm_head = param(rngs.params(), *tables["lm_head"], std=cfg.init_std, dtype=cfg.param_dtype)

    def __call__(self, tokens: jax.Array, *, segments: jax.Array | None = None, positions: jax.Array | None = None,
                 remat: str = "none") -> jax.Array:
        return self.forward(tokens, segments=segments, positions=positions, remat=remat)[0]

    def forward(self, tokens: jax.Array, *, segments: jax.Array | None = None, positions: jax.Array | None = None,
                remat: str = "none") -> tuple[jax.Array, dict[str, jax.Array]]:
        """(logits, stats): stats holds each MoE layer's router statistics stacked on a leading axis.

        With packed documents, `segments` [batch, length] (each token's document) keeps attention
        inside documents and `positions` [batch, length] (each token's place in its document) are
        RoPE's positions.
        """
        graphdef, stacked = nnx.split(self.blocks)
        # A tied table is pinned once for both uses, so its two gradients are added before the one reduce-scatter.
        table = pin(self.embedding, self.cfg.compute_dtype) if self.cfg.tie_embeddings else None
        x, stats = apply_blocks(graphdef, stacked, self.embed(tokens, table), self.cfg, remat,
                                segments=segments, positions=positions)
        return self.head(x, table), stats

    def embed(self, tokens: jax.Array, table: Pinned | None = None) -> jax.Array:
        """Token ids [batch, length] -> the residual stream [batch, length, d_model] in the compute dtype.

        `table`: the embedding already pinned (`layers.pin`) when another use shares it.
        """
        # The table in its compute layout (FSDP shards gathered, vocabulary still split): XLA's
        # partitioner cannot gather rows from a table split along `embed` inside shard_map.
        # Each vocabulary shard looks up its own rows into a full-length partial sum, which is
        # then reduced (and under sequence parallelism scattered on length) into the residual.
        with jax.named_scope("embedding"):
            rows = weight(self.embedding if table is None else table, self.cfg.compute_dtype)
            x = constrain(jnp.take(rows, tokens, axis=0), ("batch", "length", "embed"))
            return constrain(x, RESIDUAL)

    def head(self, x: jax.Array, table: Pinned | None = None) -> jax.Array:
        """Final norm and LM head: the residual stream -> logits [batch, length, vocab] (`table` as in `embed`)."""
        x = self.final_norm(x)
        dt = self.cfg.compute_dtype
        if self.cfg.tie_embeddings:
            tied = self.embedding if table is None else table
            return constrain(dense("bld,vd->blv", x, tied, dt), ("batch", "length", "vocab"))
        return constrain(dense("bld,dv->blv", x, self.lm_head, dt), ("batch", "length", "vocab"))


def apply_blocks(graphdef: nnx.GraphDef, stacked: nnx.State, x: jax.Array, cfg: ModelConfig,
                 remat: str = "none", *, segments: jax.Array | None = None, positions: jax.Array | None = None,
                 rows: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Run layers whose parameters are stacked on a leading axis (any number of them) with `lax.scan`.

    The whole model calls this on all its layers; a pipeline stage on its own slice of them.
    Returns the output and the MoE statistics of every scanned step (empty without MoE).
    `segments` and `positions` are the documents' layout, as in `Transformer.forward`.
    `rows` (a scalar, may be traced): only the first `rows` stacked rows are layers; the others are padding,
    skipped (no compute, the input passes through, zero statistics and gradients; `models.padded_row`).
    """
    if positions is not None:
        positions = constrain(positions, ("batch", "length"))
    if segments is not None:
        segments = constrain(segments, ("batch", "length"))
    cos, sin = rope_tables(x.shape[1], cfg.resolved_head_dim, cfg.rope_theta, positions, scaling=cfg.rope_scaling)

    def layer(carry, layer_params):
        return nnx.merge(graphdef, layer_params)(carry, cos, sin, segments)

    if rows is None:
        return jax.lax.scan(apply_remat(layer, remat), x, stacked)

    row = padded_row(apply_remat(layer, remat))

    def layer_or_padding(carry, xs):
        layer_params, i = xs
        return row(carry, layer_params, i < rows)

    count = jax.tree.leaves(stacked)[0].shape[0]
    return jax.lax.scan(layer_or_padding, x, (stacked, jnp.arange(count)))

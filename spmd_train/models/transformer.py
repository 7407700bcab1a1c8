"""Decoder-only Llama-style transformer in Flax NNX.

RMSNorm, rotary embeddings (optionally Llama 3.1-scaled), SwiGLU MLP, grouped-query attention (optionally
with Q/K/V biases as in Qwen2, or per-head Q/K norms as in Qwen3) or multi-head latent attention
(DeepSeek-V2, `models.mla`), tied or untied embeddings.
The layers' parameters are stacked on a leading `layers` axis and run with `lax.scan`, so
compile time does not grow with depth. The model speaks logical axis names only
(`constrain`); which mesh axes they land on is decided outside.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spmd_train.config.model_schema import BackendsConfig, ModelConfig
from spmd_train.models.flops import mtp_kind
from spmd_train.models.layers import Pinned, RMSNorm, Stack, dense, in_host_memory, param, pin, weight
from spmd_train.models.mla import MLAttention
from spmd_train.models.moe import MoE
from spmd_train.models.mtp import MTP
from spmd_train.models.padded_row import padded_row
from spmd_train.models.param_specs import attention_params, mlp_params, table_params
from spmd_train.models.remat import Remat, apply_remat, name, name_layer_input
from spmd_train.ops.attention import Scoring
from spmd_train.ops.rope import apply_rope, rope_tables, yarn_softmax_factor
from spmd_train.parallel import Backends, attention, resolve_backends
from spmd_train.sharding.constrain import constrain

RESIDUAL = ("batch", "norm_length", "embed")


class Attention(nnx.Module):
    """Grouped-query self-attention; Q/K/V column-parallel and the output row-parallel over heads.

    A model with both full and sliding layers runs each layer's attention as a `lax.switch` on its kind, so every
    branch has a static window and RoPE (kernels skip blocks outside a static window); the projections run
    outside the switch, once."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, backends: Backends, *, stack: int | None = None):
        out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
        kw = {"dtype": cfg.param_dtype, "stack": stack}
        specs = attention_params(cfg)
        self.wq = param(rngs.params(), *specs["wq"], std=cfg.init_std, **kw)
        self.wk = param(rngs.params(), *specs["wk"], std=cfg.init_std, **kw)
        self.wv = param(rngs.params(), *specs["wv"], std=cfg.init_std, **kw)
        self.wo = param(rngs.params(), *specs["wo"], std=out_std, **kw)
        if cfg.attention_sinks:
            self.sinks = param(None, *specs["sinks"], std=0.0, **kw)
        if cfg.qkv_bias:
            self.bq = param(None, *specs["bq"], std=0.0, **kw)
            self.bk = param(None, *specs["bk"], std=0.0, **kw)
            self.bv = param(None, *specs["bv"], std=0.0, **kw)
        if cfg.attn_output_bias:
            self.bo = param(None, *specs["bo"], std=0.0, **kw)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg, stack=stack, axis="head_dim")
            self.k_norm = RMSNorm(cfg, stack=stack, axis="head_dim")
        self.qkv_bias, self.qk_norm, self.has_sinks = cfg.qkv_bias, cfg.qk_norm, cfg.attention_sinks
        self.output_bias = cfg.attn_output_bias
        self.scorings = tuple(layer_scoring(cfg, kind) for kind in attention_kinds(cfg))
        self.compute_dtype = cfg.compute_dtype
        self.backends = backends

    def __call__(self, x: jax.Array, rope: tuple, segments: jax.Array | None = None,
                 kind: jax.Array | None = None) -> jax.Array:
        """`rope`: (cos, sin) per attention kind (`attention_kinds`); `kind`: this layer's index into them (traced;
        None with one kind)."""
        q, k, v = self.qkv(x)
        sinks = weight(self.sinks, jnp.float32) if self.has_sinks else None

        def branch(i):
            def run(q, k, v):
                cos, sin = rope[i]
                return attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, backends=self.backends,
                                 segments=segments, scoring=self.scorings[i], sinks=sinks)
            return run

        if len(self.scorings) == 1:
            out = branch(0)(q, k, v)
        else:
            out = jax.lax.switch(kind, [branch(i) for i in range(len(self.scorings))], q, k, v)
        return self.output(out)

    def qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The residual stream -> queries, keys and values before RoPE, [batch, length, heads, head_dim]."""
        dt = self.compute_dtype
        q = dense("bld,dhk->blhk", x, self.wq, dt)
        k = dense("bld,dhk->blhk", x, self.wk, dt)
        v = dense("bld,dhk->blhk", x, self.wv, dt)
        if self.qkv_bias:
            q, k, v = q + weight(self.bq, dt), k + weight(self.bk, dt), v + weight(self.bv, dt)
        q = name(constrain(q, ("batch", "length", "heads", "head_dim")), "query")
        k = name(constrain(k, ("batch", "length", "kv_heads", "head_dim")), "key")
        v = name(constrain(v, ("batch", "length", "kv_heads", "head_dim")), "value")
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def project(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The residual stream -> queries, keys (both rotated) and values, [batch, length, heads, head_dim]."""
        q, k, v = self.qkv(x)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def output(self, out: jax.Array) -> jax.Array:
        """The heads' attention output [batch, length, heads, head_dim] -> the residual stream's update."""
        out = name(constrain(out, ("batch", "length", "heads", "head_dim")), "attention_out")
        out = dense("blhk,hkd->bld", out, self.wo, self.compute_dtype)
        if self.output_bias:  # added once, after the heads' row-parallel sum
            out = out + weight(self.bo, self.compute_dtype)
        return constrain(out, RESIDUAL)


def attention_kinds(cfg: ModelConfig) -> tuple[str, ...]:
    """The attention kinds the model's layers use, sorted: ("full",), ("sliding",) or ("full", "sliding")."""
    return tuple(sorted(cfg.attention_kinds))


def layer_scoring(cfg: ModelConfig, kind: str) -> Scoring:
    """How a `kind` layer scores q.k: the query scale, the logit soft-cap and (sliding) the window. MLA under YaRN
    with mscale_all_dim scales its logits by `yarn_softmax_factor` too, as DeepSeek's attention does."""
    scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar ** -0.5
    factor = yarn_softmax_factor(cfg.rope_scaling) if cfg.mla is not None else 1.0
    if factor != 1.0:
        scale = (scale if scale is not None else cfg.resolved_head_dim ** -0.5) * factor
    return Scoring(scale=scale, softcap=cfg.attn_logit_softcap, window=cfg.window_of(kind))


def layer_kind_ids(cfg: ModelConfig) -> np.ndarray:
    """Each stacked row's layers' kinds as indices into `attention_kinds`: [stack_rows], or [stack_rows, moe.every]
    for MoE groups (every > 1 layers ending in an MoE layer); the first_dense layers' are `first_kind_ids`."""
    ids = _kind_ids(cfg)[cfg.first_dense:]
    return ids.reshape(cfg.stack_rows, cfg.moe_every) if cfg.moe_every > 1 else ids


def first_kind_ids(cfg: ModelConfig) -> np.ndarray:
    """The kinds of the model.moe.first_k_dense layers (`first_blocks`), as `layer_kind_ids`: [first_dense]."""
    return _kind_ids(cfg)[: cfg.first_dense]


def _kind_ids(cfg: ModelConfig) -> np.ndarray:
    kinds = attention_kinds(cfg)
    return np.array([kinds.index(kind) for kind in cfg.layer_kinds], np.int32)


def rope_of(cfg: ModelConfig, length: int, positions: jax.Array | None) -> tuple:
    """(cos, sin) per attention kind over the rotated width (`rope_head_dim`): sliding layers take
    model.rope_local_theta, unscaled, when it is set."""
    def tables(kind):
        if kind == "sliding" and cfg.rope_local_theta is not None:
            return rope_tables(length, cfg.rope_head_dim, cfg.rope_local_theta, positions)
        return rope_tables(length, cfg.rope_head_dim, cfg.rope_theta, positions, scaling=cfg.rope_scaling)
    return tuple(tables(kind) for kind in attention_kinds(cfg))


class MLP(nnx.Module):
    """Gated feed-forward, SwiGLU or GeGLU (model.mlp_activation); gate/up column-parallel, down row-parallel over
    `mlp`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *, stack: int | None = None):
        out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
        kw = {"dtype": cfg.param_dtype, "stack": stack}
        specs = mlp_params(cfg)
        self.w_gate = param(rngs.params(), *specs["w_gate"], std=cfg.init_std, **kw)
        self.w_up = param(rngs.params(), *specs["w_up"], std=cfg.init_std, **kw)
        self.w_down = param(rngs.params(), *specs["w_down"], std=out_std, **kw)
        self.compute_dtype, self.activation = cfg.compute_dtype, cfg.mlp_activation

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.compute_dtype
        gate = name(constrain(dense("bld,df->blf", x, self.w_gate, dt), ("batch", "length", "mlp")), "mlp_gate")
        up = name(constrain(dense("bld,df->blf", x, self.w_up, dt), ("batch", "length", "mlp")), "mlp_up")
        hidden = name(gate_activation(gate, self.activation) * up, "mlp_hidden")
        return constrain(dense("blf,fd->bld", hidden, self.w_down, dt), RESIDUAL)


def gate_activation(gate: jax.Array, activation: str) -> jax.Array:
    """silu(gate) for SwiGLU, or the tanh-approximated GELU for GeGLU (Gemma's gelu_pytorch_tanh)."""
    return jax.nn.silu(gate) if activation == "silu" else jax.nn.gelu(gate, approximate=True)


class Block(nnx.Module):
    """Pre-norm transformer layer: x + attn(norm(x)), then + mlp(norm(x)); the MLP may be an MoE layer. With
    model.sandwich_norms each update is normalised again before its add: x + norm(attn(norm(x))) (Gemma 2/3).

    Returns (x, stats): the MoE layer's router statistics, or an empty dict. `rope`: (cos, sin) per attention
    kind; `segments` [batch, length]: each token's document, when attention must stay inside documents; `kind`:
    the layer's attention kind (`Attention.__call__`).
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, backends: Backends, *, stack=None, moe: bool = False):
        self.attn_norm = RMSNorm(cfg, stack=stack)
        if cfg.mla is None:
            self.attn = Attention(cfg, rngs, backends, stack=stack)
        else:
            scorings = tuple(layer_scoring(cfg, kind) for kind in attention_kinds(cfg))
            self.attn = MLAttention(cfg, rngs, backends, scorings=scorings, stack=stack)
        self.mlp_norm = RMSNorm(cfg, stack=stack)
        self.mlp = MoE(cfg, rngs, backends, stack=stack) if moe else MLP(cfg, rngs, stack=stack)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.attn_post_norm = RMSNorm(cfg, stack=stack)
            self.mlp_post_norm = RMSNorm(cfg, stack=stack)

    def __call__(self, x: jax.Array, rope: tuple, segments: jax.Array | None = None,
                 kind: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        with jax.named_scope("attention"):
            x = self.add_attention(x, self.attn(constrain(self.attn_norm(x), RESIDUAL), rope, segments, kind))
        with jax.named_scope("mlp"):
            out = self.mlp(constrain(self.mlp_norm(x), RESIDUAL))
        out, stats = out if isinstance(out, tuple) else (out, {})
        return self.add_mlp(x, out), stats

    def add_attention(self, x: jax.Array, update: jax.Array) -> jax.Array:
        """The residual stream after the attention's `update` (normalised first with model.sandwich_norms)."""
        return x + (constrain(self.attn_post_norm(update), RESIDUAL) if self.sandwich else update)

    def add_mlp(self, x: jax.Array, update: jax.Array) -> jax.Array:
        """The residual stream after the MLP's `update` (normalised first with model.sandwich_norms)."""
        return constrain(x + (self.mlp_post_norm(update) if self.sandwich else update), RESIDUAL)


class MoEGroup(nnx.Module):
    """model.moe.every = k > 1: k - 1 dense layers (stacked on `sublayers`), then one MoE layer."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, backends: Backends, *, stack: int):
        self.dense = Block(cfg, rngs, backends, stack=(stack, cfg.moe_every - 1))
        self.moe = Block(cfg, rngs, backends, stack=stack, moe=True)

    def __call__(self, x: jax.Array, rope: tuple, segments: jax.Array | None = None,
                 kind: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`kind`: the group's layers' kinds [k] (None with one kind)."""
        graphdef, stacked = nnx.split(self.dense)
        kinds = None if kind is None else kind[:-1]
        x, _ = jax.lax.scan(lambda c, xs: (nnx.merge(graphdef, xs[0])(c, rope, segments, xs[1])[0], None), x,
                            (stacked, kinds))
        return self.moe(x, rope, segments, None if kind is None else kind[-1])


def make_blocks(cfg: ModelConfig, rngs: nnx.Rngs, backends: Backends) -> nnx.Module:
    """The layer stack after any first_dense layers: L dense layers, L MoE layers (model.moe.every=1), or L/k groups
    ending in an MoE layer."""
    k = cfg.moe_every
    if k == 0:
        return Block(cfg, rngs, backends, stack=cfg.num_layers)
    if k == 1:
        return Block(cfg, rngs, backends, stack=cfg.stack_rows, moe=True)
    return MoEGroup(cfg, rngs, backends, stack=cfg.stack_rows)


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
        if cfg.first_dense:
            # model.moe.first_k_dense: dense layers before the MoE pattern, a scanned stack of their own (the
            # `blocks` stack keeps one row shape, so scans, pipelines and layer orders treat it as before).
            self.first_blocks = Block(cfg, rngs, backends, stack=Stack((cfg.first_dense,), ("first_layers",)))
        self.blocks = make_blocks(cfg, rngs, backends)
        self.final_norm = RMSNorm(cfg)
        if "lm_head" in tables:
            self.lm_head = param(rngs.params(), *tables["lm_head"], std=cfg.init_std, dtype=cfg.param_dtype)
        if cfg.mtp is not None:
            self.mtp = MTP(cfg, rngs, backends, Block)

    def __call__(self, tokens: jax.Array, *, segments: jax.Array | None = None, positions: jax.Array | None = None,
                 remat: Remat = "none") -> jax.Array:
        return self.forward(tokens, segments=segments, positions=positions, remat=remat)[0]

    def forward(self, tokens: jax.Array, *, segments: jax.Array | None = None, positions: jax.Array | None = None,
                remat: Remat = "none") -> tuple[jax.Array, dict[str, jax.Array]]:
        """(logits, stats): stats holds each MoE layer's router statistics stacked on a leading axis.

        With packed documents, `segments` [batch, length] (each token's document) keeps attention
        inside documents and `positions` [batch, length] (each token's place in its document) are
        RoPE's positions.
        """
        table = self.shared_table()
        x, stats = self.trunk(tokens, table, segments=segments, positions=positions, remat=remat)
        return self.head(x, table), stats

    def forward_mtp(self, tokens: jax.Array, ahead: list[jax.Array], *, segments: jax.Array | None = None,
                    positions: jax.Array | None = None, remat: Remat = "none"
                    ) -> tuple[jax.Array, list[jax.Array], dict[str, jax.Array]]:
        """(logits, each multi-token prediction depth's logits, stats) for a model with model.mtp: `ahead[k]` [batch,
        length] holds, at each position i, the token k + 1 places ahead (`train.inputs.mtp_inputs`). The MTP layers'
        router statistics follow the trunk's on the leading axis."""
        table = self.shared_table()
        x, stats = self.trunk(tokens, table, segments=segments, positions=positions, remat=remat)
        logits = self.head(x, table)
        cfg = self.cfg
        kinds = attention_kinds(cfg)
        kind = None if len(kinds) == 1 else jnp.asarray(kinds.index(mtp_kind(cfg)), jnp.int32)
        rope = rope_of(cfg, tokens.shape[1], None if positions is None else constrain(positions, ("batch", "length")))
        embedded = [self.embed(t, table) for t in ahead]
        outputs, mtp_stats = self.mtp(x, embedded, rope, segments, kind, remat)
        mtp_logits = [self.head(out, table, normed=True) for out in outputs]
        if mtp_stats[0]:
            stats = {key: jnp.concatenate([stats[key], jnp.stack([s[key] for s in mtp_stats])]) for key in stats}
        return logits, mtp_logits, stats

    def shared_table(self) -> Pinned | None:
        """The tied table pinned once for all its uses, so its gradients are added before the one reduce-scatter."""
        return pin(self.embedding, self.cfg.compute_dtype) if self.cfg.tie_embeddings else None

    def trunk(self, tokens: jax.Array, table: Pinned | None = None, *, segments: jax.Array | None = None,
              positions: jax.Array | None = None, remat: Remat = "none") -> tuple[jax.Array, dict[str, jax.Array]]:
        """Tokens -> (the last layer's residual stream, before the final norm; the MoE statistics)."""
        graphdef, stacked = nnx.split(self.blocks)
        x = self.first_layers(self.embed(tokens, table), segments=segments, positions=positions, remat=remat)
        return apply_blocks(graphdef, stacked, x, self.cfg, remat, segments=segments, positions=positions)

    def first_layers(self, x: jax.Array, *, segments: jax.Array | None = None, positions: jax.Array | None = None,
                     remat: Remat = "none") -> jax.Array:
        """The model.moe.first_k_dense dense layers (`first_blocks`) on the embedded stream; x itself without them."""
        if not self.cfg.first_dense:
            return x
        first_def, first_stacked = nnx.split(self.first_blocks)
        return apply_blocks(first_def, first_stacked, x, self.cfg, remat, segments=segments, positions=positions,
                            kinds=jnp.asarray(first_kind_ids(self.cfg)))[0]

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
            if self.cfg.scale_embeddings:  # sqrt(d_model) rounded to the compute dtype first, as Gemma's checkpoints
                x = x * jnp.asarray(self.cfg.d_model**0.5, x.dtype)
            return constrain(x, RESIDUAL)

    def head(self, x: jax.Array, table: Pinned | None = None, *, normed: bool = False) -> jax.Array:
        """Final norm and LM head: the residual stream -> logits [batch, length, vocab] (`table` as in `embed`),
        soft-capped when model.final_logit_softcap is set. `normed`: x is already normalised (an MTP module's own
        head norm), so the final norm is skipped."""
        x = x if normed else self.final_norm(x)
        dt = self.cfg.compute_dtype
        if self.cfg.tie_embeddings:
            logits = dense("bld,vd->blv", x, self.embedding if table is None else table, dt)
        else:
            logits = dense("bld,dv->blv", x, self.lm_head, dt)
        cap = self.cfg.final_logit_softcap
        if cap is not None:
            logits = (cap * jnp.tanh(logits.astype(jnp.float32) / cap)).astype(logits.dtype)
        return constrain(logits, ("batch", "length", "vocab"))


def fetched(tree: Any) -> Any:
    """`tree` with its arrays in host memory (offload.params: the layer stack's, a layer at a time inside the layer
    loop) brought to the device. The barrier keeps each transfer a copy of this device's shard: without it XLA may
    gather the layer across devices on the host, moving the whole layer over the host link (measured on v5p)."""
    leaves, treedef = jax.tree.flatten(tree)
    host = [in_host_memory(x) for x in leaves]
    if not any(host):
        return tree
    moved = [jax.device_put(x, jax.memory.Space.Device) if h else x for x, h in zip(leaves, host, strict=True)]
    return jax.tree.unflatten(treedef, jax.lax.optimization_barrier(moved))


def apply_blocks(graphdef: nnx.GraphDef, stacked: nnx.State, x: jax.Array, cfg: ModelConfig,
                 remat: Remat = "none", *, segments: jax.Array | None = None, positions: jax.Array | None = None,
                 rows: jax.Array | None = None, kinds: jax.Array | None = None
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Run layers whose parameters are stacked on a leading axis (any number of them) with `lax.scan`.

    The whole model calls this on all its layers; a pipeline stage on its own slice of them.
    Returns the output and the MoE statistics of every scanned step (empty without MoE).
    `segments` and `positions` are the documents' layout, as in `Transformer.forward`.
    `rows` (a scalar, may be traced): only the first `rows` stacked rows are layers; the others are padding,
    skipped (no compute, the input passes through, zero statistics and gradients; `models.padded_row`).
    `kinds`: the stacked rows' attention kinds (`layer_kind_ids`' rows for these layers), needed when the model has
    both full and sliding layers and these are not all of them in order.
    """
    if positions is not None:
        positions = constrain(positions, ("batch", "length"))
    if segments is not None:
        segments = constrain(segments, ("batch", "length"))
    rope = rope_of(cfg, x.shape[1], positions)
    count = jax.tree.leaves(stacked)[0].shape[0]
    if len(attention_kinds(cfg)) == 1:
        kinds = None
    elif kinds is None:
        kinds = jnp.asarray(layer_kind_ids(cfg))
        if kinds.shape[0] != count:
            raise ValueError(f"{count} stacked rows are not the model's {kinds.shape[0]}: pass their layers' kinds")

    def layer(carry, layer_params, kind):
        return nnx.merge(graphdef, fetched(layer_params))(name_layer_input(carry), rope, segments, kind)

    if rows is None:
        body = apply_remat(layer, remat)
        return jax.lax.scan(lambda carry, xs: body(carry, *xs), x, (stacked, kinds))

    row = padded_row(apply_remat(layer, remat))

    def layer_or_padding(carry, xs):
        layer_params, kind, i = xs
        return row(carry, layer_params, i < rows, kind)

    return jax.lax.scan(layer_or_padding, x, (stacked, kinds, jnp.arange(count)))

"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) in Flax NNX: the attention of a layer when model.mla is set.

Each token's keys and values come from one low-rank latent (kv_lora_rank wide, RMS-normalised) expanded per head,
and queries optionally from a second latent (q_lora_rank). RoPE turns only the last qk_rope_head_dim channels of
each query and one rotated key per token that every head shares (the "decoupled" RoPE key, which keeps the latent
position-free, so the decode cache holds the latent and that key alone: `absorbed`, `models.decode`). Queries and
keys are qk_nope_head_dim + qk_rope_head_dim wide, values v_head_dim: the attention implementations take values of
another width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from spmd_train.config.model_schema import ModelConfig
from spmd_train.models.layers import RMSNorm, dense, param, weight
from spmd_train.models.param_specs import mla_params
from spmd_train.ops.attention import Scoring
from spmd_train.ops.rope import apply_rope
from spmd_train.parallel import Backends, attention
from spmd_train.sharding.constrain import constrain

HEADS = ("batch", "length", "heads", "head_dim")
KV_HEADS = ("batch", "length", "kv_heads", "head_dim")


class MLAttention(nnx.Module):
    """DeepSeek-V2's latent attention; the per-head expansions column-parallel and the output row-parallel over
    heads, the latents replicated (they are narrow).

    Same call as `transformer.Attention`: `rope` holds (cos, sin) per attention kind, qk_rope_head_dim // 2 wide;
    `scorings` each kind's `Scoring` (full or sliding layers compose with MLA as with grouped-query attention)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, backends: Backends, *, scorings: tuple[Scoring, ...],
                 stack: int | None = None):
        a = cfg.mla
        out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
        kw = {"dtype": cfg.param_dtype, "stack": stack}
        specs = mla_params(cfg)
        self.q_lora = a.q_lora_rank is not None
        if self.q_lora:
            self.wq_a = param(rngs.params(), *specs["wq_a"], std=cfg.init_std, **kw)
            self.q_norm = RMSNorm(cfg, stack=stack, axis="q_lora")
            self.wq_b = param(rngs.params(), *specs["wq_b"], std=cfg.init_std, **kw)
        else:
            self.wq = param(rngs.params(), *specs["wq"], std=cfg.init_std, **kw)
        self.wkv_a = param(rngs.params(), *specs["wkv_a"], std=cfg.init_std, **kw)
        self.kv_norm = RMSNorm(cfg, stack=stack, axis="kv_lora")
        self.wkv_b = param(rngs.params(), *specs["wkv_b"], std=cfg.init_std, **kw)
        self.wo = param(rngs.params(), *specs["wo"], std=out_std, **kw)
        self.has_sinks = cfg.attention_sinks
        if self.has_sinks:
            self.sinks = param(None, *specs["sinks"], std=0.0, **kw)
        self.kv_rank, self.nope, self.rope_dim = a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim
        self.scorings = scorings
        self.compute_dtype = cfg.compute_dtype
        self.backends = backends

    def __call__(self, x: jax.Array, rope: tuple, segments: jax.Array | None = None,
                 kind: jax.Array | None = None) -> jax.Array:
        """The residual stream [batch, length, d_model] -> this layer's update to it."""
        q, k_nope, k_rope, v = self.latent_qkv(x)
        sinks = weight(self.sinks, jnp.float32) if self.has_sinks else None

        def branch(i):
            def run(q, k_nope, k_rope, v):
                q, k = self.rotate(q, k_nope, k_rope, *rope[i])
                return attention(q, k, v, backends=self.backends, segments=segments, scoring=self.scorings[i],
                                 sinks=sinks)
            return run

        if len(self.scorings) == 1:
            out = branch(0)(q, k_nope, k_rope, v)
        else:
            out = jax.lax.switch(kind, [branch(i) for i in range(len(self.scorings))], q, k_nope, k_rope, v)
        return self.output(out)

    def queries(self, x: jax.Array) -> jax.Array:
        """The residual stream -> queries [b, l, heads, nope + rope] before RoPE."""
        dt = self.compute_dtype
        if self.q_lora:
            latent = constrain(dense("bld,dr->blr", x, self.wq_a, dt), ("batch", "length", "q_lora"))
            return constrain(dense("blr,rhk->blhk", self.q_norm(latent), self.wq_b, dt), HEADS)
        return constrain(dense("bld,dhk->blhk", x, self.wq, dt), HEADS)

    def latent(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The residual stream -> each token's normalised key/value latent [b, l, kv_lora_rank] and its shared key's
        rope part [b, l, 1, rope] before RoPE."""
        kv = constrain(dense("bld,dr->blr", x, self.wkv_a, self.compute_dtype), ("batch", "length", "kv_lora"))
        return self.kv_norm(kv[..., : self.kv_rank]), kv[:, :, None, self.kv_rank:]

    def latent_qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """The residual stream -> queries [b, l, heads, nope + rope] (before RoPE), the keys' nope parts
        [b, l, heads, nope], the shared key's rope part [b, l, 1, rope] (before RoPE) and values [b, l, heads, v]."""
        latent, k_rope = self.latent(x)
        expanded = constrain(dense("blr,rhk->blhk", latent, self.wkv_b, self.compute_dtype), KV_HEADS)
        return self.queries(x), expanded[..., : self.nope], k_rope, expanded[..., self.nope:]

    def absorbed(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """For attention over the compressed cache: queries [b, l, heads, kv_lora_rank + rope] whose nope part is
        taken into latent space (q_nope . wkv_b's key columns, so q.k = q_latent . latent + q_rope . k_rope), and each
        token's cache entry [b, l, 1, kv_lora_rank + rope]: its normalised latent, then its rotated shared key.
        Attention over the entries with the latents as values, then `absorbed_output`, is this layer's attention."""
        q = self.queries(x)
        latent, k_rope = self.latent(x)
        w = weight(self.wkv_b, self.compute_dtype)[..., : self.nope]
        q_latent = jnp.einsum("blhn,rhn->blhr", q[..., : self.nope], w)
        q = jnp.concatenate([q_latent, apply_rope(q[..., self.nope:], cos, sin).astype(q_latent.dtype)], axis=-1)
        return constrain(q, HEADS), jnp.concatenate([latent[:, :, None], apply_rope(k_rope, cos, sin)], axis=-1)

    def absorbed_output(self, out: jax.Array) -> jax.Array:
        """Attention output in latent space [b, l, heads, kv_lora_rank] -> the residual stream's update (through
        wkv_b's value columns, then wo)."""
        w = weight(self.wkv_b, self.compute_dtype)[..., self.nope:]
        return self.output(jnp.einsum("blhr,rhv->blhv", out, w))

    def scale(self, scoring: Scoring) -> float:
        """The softmax scale of `scoring`: its own, else 1 / sqrt(nope + rope), the queries' width before absorption."""
        return scoring.scale if scoring.scale is not None else (self.nope + self.rope_dim) ** -0.5

    def rotate(self, q: jax.Array, k_nope: jax.Array, k_rope: jax.Array, cos: jax.Array, sin: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
        """Queries with their rope part rotated, and each head's key: its nope part, then the shared rotated key."""
        q = jnp.concatenate([q[..., : self.nope], apply_rope(q[..., self.nope:], cos, sin)], axis=-1)
        k_rope = jnp.broadcast_to(apply_rope(k_rope, cos, sin), (*k_nope.shape[:3], k_rope.shape[-1]))
        return constrain(q, HEADS), constrain(jnp.concatenate([k_nope, k_rope], axis=-1), KV_HEADS)

    def output(self, out: jax.Array) -> jax.Array:
        """The heads' attention output [batch, length, heads, v_head_dim] -> the residual stream's update."""
        out = constrain(out, HEADS)
        return constrain(dense("blhk,hkd->bld", out, self.wo, self.compute_dtype), ("batch", "norm_length", "embed"))

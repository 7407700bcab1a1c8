"""Text generation with a KV cache: a prefill over the prompts, then one token per step.

The model's own modules and parameters run the layers; only attention differs from training: queries attend to
a cache of keys and values (static length, left-padded prompts) instead of to their own sequence. Everything here
speaks logical axis names (`constrain`); the caller sets the layout.

Details: docs/generate.md#how-it-works
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spmd_train.models.layers import weight
from spmd_train.models.mla import MLAttention
from spmd_train.models.transformer import (
    RESIDUAL,
    Block,
    MoEGroup,
    Transformer,
    first_kind_ids,
    layer_kind_ids,
    rope_of,
)
from spmd_train.ops.attention import FULL, Scoring, visible
from spmd_train.sharding.constrain import constrain

CACHE_AXES = (None, "batch", None, "kv_heads", "head_dim")
"""Logical axes of the cache [layers, batch, slots, kv_heads, head_dim]: rows over the batch axes, K/V heads
over `tensor`, like the activations they came from. Its length is never split: a step writes one slot."""
LATENT_AXES = (None, "batch", None, None, "kv_lora")
"""Logical axes of an MLA model's cache [layers, batch, slots, 1, kv_lora_rank + qk_rope_head_dim]: one entry per
token that every head reads, so it is not split over heads."""


class Cache(NamedTuple):
    """Keys and values of the full layers [full layers, batch, max_len, kv_heads, head_dim], and of the sliding
    layers in a ring of their window's slots [sliding layers, batch, window, kv_heads, head_dim] (slot t at t mod
    window), each in model layer order; a kind the model lacks has 0 layers. With MLA the keys are each token's
    compressed entry [.., 1, kv_lora_rank + qk_rope_head_dim] (latent, rotated shared key) and the values are empty:
    attention reads the latents as values (`MLAttention.absorbed`)."""

    k: jax.Array
    v: jax.Array
    k_local: jax.Array
    v_local: jax.Array


def cache_axes(cfg) -> tuple[str | None, ...]:
    """The logical axes of the model's cache arrays: `CACHE_AXES`, or `LATENT_AXES` with MLA."""
    return CACHE_AXES if cfg.mla is None else LATENT_AXES


def cache_shapes(cfg, batch: int, max_len: int) -> Cache:
    """The cache's shapes and dtypes for `batch` rows of `max_len` slots: a sliding layer's does not grow with
    max_len (it holds model.sliding_window slots at most)."""
    kinds = cfg.layer_kinds
    full, local = kinds.count("full"), kinds.count("sliding")
    ring = min(cfg.sliding_window or 0, max_len)
    dt = jnp.dtype(cfg.compute_dtype)
    if cfg.mla is None:
        k_tail = v_tail = (cfg.num_kv_heads, cfg.resolved_head_dim)
    else:
        k_tail, v_tail = (1, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim), (1, 0)
    return Cache(*(jax.ShapeDtypeStruct((n, batch, slots, *tail), dt) for n, slots in ((full, max_len), (local, ring))
                   for tail in (k_tail, v_tail)))


def empty_cache(model: Transformer, batch: int, max_len: int) -> Cache:
    """A zero cache for `batch` rows of `max_len` tokens."""
    axes = cache_axes(model.cfg)
    return Cache(*(constrain(jnp.zeros(s.shape, s.dtype), axes) for s in cache_shapes(model.cfg, batch, max_len)))


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scoring: Scoring = FULL,
                     sinks: jax.Array | None = None) -> jax.Array:
    """q [b, l, h, d] against a cache k [b, T, kvh, d], v [b, T, kvh, dv] -> [b, l, h, dv]; `mask` [b, l, T]: which keys
    each query sees (the window included); `scoring`'s scale and soft-cap and the `sinks` [h] as in training.

    The numerics of `ops.attention.dot_product_attention` (grouped-query, fp32 scores and softmax).
    """
    b, lq, h, d = q.shape
    kvh = k.shape[2]
    scale = scoring.scale if scoring.scale is not None else d**-0.5
    qg = q.reshape(b, lq, kvh, h // kvh, d)
    s = jnp.einsum("blkgd,bmkd->bkglm", qg, k, preferred_element_type=jnp.float32) * scale
    if scoring.softcap is not None:
        s = scoring.softcap * jnp.tanh(s / scoring.softcap)
    s = jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min)
    if sinks is None:
        p = jax.nn.softmax(s, axis=-1)
    else:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kvh, h // kvh, 1, 1), (*s.shape[:-1], 1))
        p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bkglm,bmkd->blkgd", p.astype(v.dtype), v).reshape(b, lq, h, v.shape[-1]).astype(q.dtype)


def _block_step(block: Block, x: jax.Array, rope: tuple, mask: jax.Array, cache: Cache, layer: jax.Array,
                start: jax.Array, kind: jax.Array, pads: jax.Array) -> tuple[jax.Array, Cache]:
    """`Block.__call__` for tokens at cache slots start .. start + l - 1, reading and writing the cache of model
    layer `layer` (its index among the layers of its kind, traced), whose attention kind is `kind` (an index into
    `attention_kinds`, traced); `mask` [b, l, max_len]: the full layers' visible slots."""
    attn, kinds = block.attn, block.attn.scorings
    cos = jnp.stack([c for c, _ in rope])[kind]
    sin = jnp.stack([s for _, s in rope])[kind]
    x_in = constrain(block.attn_norm(x), RESIDUAL)
    if isinstance(attn, MLAttention):  # the compressed cache: attention in latent space, values the latents
        q, k = attn.absorbed(x_in, cos, sin)
        v, output, latent, axes = k[..., :0], attn.absorbed_output, attn.kv_rank, LATENT_AXES
        kinds = tuple(dataclasses.replace(sc, scale=attn.scale(sc)) for sc in kinds)
    else:
        (q, k, v), output, latent, axes = attn.project(x_in, cos, sin), attn.output, None, CACHE_AXES
    sinks = weight(attn.sinks, jnp.float32) if attn.has_sinks else None
    branches = [_full_step if sc.window is None else _sliding_step for sc in kinds]

    def run(i):
        return lambda q, k, v, cache: branches[i](q, k, v, cache, layer, start, mask, pads, kinds[i], sinks,
                                                  latent=latent, axes=axes)

    if len(kinds) == 1:
        out, cache = run(0)(q, k, v, cache)
    else:
        out, cache = jax.lax.switch(kind, [run(i) for i in range(len(kinds))], q, k, v, cache)
    x = block.add_attention(x, output(out))
    out = block.mlp(constrain(block.mlp_norm(x), RESIDUAL))
    out = out[0] if isinstance(out, tuple) else out  # an MoE layer's router statistics are not needed
    return block.add_mlp(x, out), cache


def _values(keys: jax.Array, values: jax.Array, latent: int | None) -> jax.Array:
    """The values attention reads: the cached ones, or (MLA, `latent` wide) the latent part of the cached keys."""
    return values if latent is None else keys[..., :latent]


def _full_step(q, k, v, cache: Cache, layer, start, mask, pads, scoring: Scoring, sinks, *, latent, axes):
    """A full layer: write the new keys and values at their slots, attend over every slot up to each query's."""
    j, dt = layer, cache.k.dtype
    ks = constrain(jax.lax.dynamic_update_slice(cache.k, k[None].astype(dt), (j, 0, start, 0, 0)), axes)
    vs = constrain(jax.lax.dynamic_update_slice(cache.v, v[None].astype(dt), (j, 0, start, 0, 0)), axes)
    keys = constrain(ks[j], axes[1:])
    out = cached_attention(q, keys, _values(keys, constrain(vs[j], axes[1:]), latent), mask, scoring, sinks)
    return out, cache._replace(k=ks, v=vs)


def _sliding_step(q, k, v, cache: Cache, layer, start, mask, pads, scoring: Scoring, sinks, *, latent, axes):
    """A sliding layer: attend over the ring (the slots before `start` it still holds) and the new tokens, then
    keep the last window of the new tokens in the ring, so its memory does not grow with the generated length."""
    j = layer
    ring_k, ring_v = cache.k_local[j], cache.v_local[j]
    size, length = ring_k.shape[1], q.shape[1]
    entries = jnp.arange(size)
    held = start - 1 - jnp.mod(start - 1 - entries, size)  # the latest slot before `start` at each entry (< 0: none)
    key_slots = jnp.concatenate([held, start + jnp.arange(length)])
    q_slots = start + jnp.arange(length)
    seen = visible(q_slots[None, :, None], key_slots[None, None, :], causal=True, window=scoring.window)
    seen = seen & (key_slots[None, None, :] >= pads[:, None, None])  # slots before a row's padding end are padding
    dt = ring_k.dtype
    keys = jnp.concatenate([ring_k, k.astype(dt)], axis=1)
    values = jnp.concatenate([ring_v, v.astype(dt)], axis=1)
    out = cached_attention(q, keys, _values(keys, values, latent), seen, scoring, sinks)
    kept = min(length, size)  # static: more new tokens than the ring holds keep their last `size`
    at = jnp.mod(start + length - kept + jnp.arange(kept), size)
    ring_k = ring_k.at[:, at].set(k[:, length - kept:].astype(dt))
    ring_v = ring_v.at[:, at].set(v[:, length - kept:].astype(dt))
    k_local = constrain(cache.k_local.at[j].set(ring_k), axes)
    v_local = constrain(cache.v_local.at[j].set(ring_v), axes)
    return out, cache._replace(k_local=k_local, v_local=v_local)


def forward_cached(model: Transformer, tokens: jax.Array, pads: jax.Array, start: jax.Array | int,
                   cache: Cache, *, last_only: bool = False) -> tuple[jax.Array, Cache]:
    """Tokens [batch, l] at cache slots start .. start + l - 1 -> (logits [batch, l or 1, vocab] fp32, the cache with
    their keys and values written).

    `pads` [batch]: the padding slots at the start of each row. `last_only`: logits of the last token only.
    """
    cfg = model.cfg
    length, max_len = tokens.shape[1], cache.k.shape[2]
    slots = start + jnp.arange(length)
    pads = constrain(pads, ("batch",))
    positions = constrain(jnp.maximum(slots[None, :] - pads[:, None], 0), ("batch", "length"))
    rope = rope_of(cfg, length, positions)
    kinds = jnp.asarray(np.concatenate([first_kind_ids(cfg), layer_kind_ids(cfg).reshape(-1)]))
    # Each layer's index among the layers of its own kind: its row of the full or of the sliding cache.
    layer_kinds = np.asarray(cfg.layer_kinds)
    among = jnp.asarray([int((layer_kinds[:i] == kind).sum()) for i, kind in enumerate(layer_kinds)])
    keys = jnp.arange(max_len)
    mask = (keys[None, None, :] <= slots[None, :, None]) & (keys[None, None, :] >= pads[:, None, None])

    graphdef, stacked = nnx.split(model.blocks)
    x = model.embed(tokens)
    first = cfg.first_dense
    if first:  # model.moe.first_k_dense's dense layers, then the stack (layer indices offset by `first`)
        first_def, first_stacked = nnx.split(model.first_blocks)

        def first_layer(carry, xs):
            params, i = xs
            return _block_step(nnx.merge(first_def, params), carry[0], rope, mask, carry[1], among[i], start,
                               kinds[i], pads), None

        (x, cache), _ = jax.lax.scan(first_layer, (x, cache), (first_stacked, jnp.arange(first)))
    if isinstance(model.blocks, MoEGroup):
        every = cfg.moe_every

        def group(carry, xs):
            x, cache = carry
            params, g = xs
            merged = nnx.merge(graphdef, params)
            dense_def, dense_stack = nnx.split(merged.dense)

            def sublayer(carry, xs):
                p, j = xs
                i = first + g * every + j
                return _block_step(nnx.merge(dense_def, p), carry[0], rope, mask, carry[1], among[i], start,
                                   kinds[i], pads), None

            (x, cache), _ = jax.lax.scan(sublayer, (x, cache), (dense_stack, jnp.arange(every - 1)))
            i = first + g * every + every - 1
            return _block_step(merged.moe, x, rope, mask, cache, among[i], start, kinds[i], pads), None

        (x, cache), _ = jax.lax.scan(group, (x, cache), (stacked, jnp.arange(cfg.stack_rows)))
    else:
        def layer(carry, xs):
            params, i = xs
            return _block_step(nnx.merge(graphdef, params), carry[0], rope, mask, carry[1], among[i], start,
                               kinds[i], pads), None

        (x, cache), _ = jax.lax.scan(layer, (x, cache), (stacked, jnp.arange(first, cfg.num_layers)))
    if last_only:
        x = x[:, -1:]
    return model.head(x).astype(jnp.float32), cache


class Sampling(NamedTuple):
    """How the next token is chosen from the logits [batch, vocab]: the argmax when `greedy` (the one choice that
    shapes the program), else a draw at `temperature` from the `top_k` most likely tokens (all: the vocabulary size),
    cut to the fewest whose probability reaches `top_p` (1: no cut)."""

    greedy: bool
    temperature: jax.Array | float = 1.0
    top_k: jax.Array | int | None = None
    top_p: jax.Array | float = 1.0


def choose(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """The next token of each row [batch] from logits [batch, vocab] (fp32).

    Sampled: logits / temperature, then the top_k largest kept, then the smallest set of the most likely
    tokens whose probability reaches top_p (the token that crosses it included), then a categorical draw.
    One sort serves both cuts, so top_k and top_p are values, not shapes: changing them compiles nothing.
    """
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    vocab = logits.shape[-1]
    logits = logits / sampling.temperature
    top_k = vocab if sampling.top_k is None else sampling.top_k
    ordered = jnp.sort(logits, axis=-1)[:, ::-1]
    ordered = jnp.where(jnp.arange(vocab) < top_k, ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the more likely tokens
    # Rank 0 always stays; at top_p >= 1 nothing is cut (cumsum's rounding could otherwise cut the least likely).
    keep = (jnp.arange(vocab) == 0) | ((before < sampling.top_p) | (sampling.top_p >= 1)) & (ordered > -jnp.inf)
    threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def prefill(model: Transformer, tokens: jax.Array, pads: jax.Array, max_len: int, key: jax.Array,
            sampling: Sampling) -> tuple[Cache, jax.Array]:
    """Left-padded prompts [batch, P] -> (the cache of `max_len` slots holding their keys and values, the first
    new token of each row [batch])."""
    cache = empty_cache(model, tokens.shape[0], max_len)
    logits, cache = forward_cached(model, tokens, pads, 0, cache, last_only=True)
    return cache, choose(logits[:, 0], jax.random.fold_in(key, 0), sampling)


class Decoded(NamedTuple):
    """What `decode` made: tokens [batch, steps] (row b's own are its first lengths[b]; the rest, zeros or tokens
    made after its stop, are not part of it), `lengths` [batch], `stopped` [batch] (whether the row's last own token
    is a stop id), and `steps_run` (scalar: the tokens the loop made per row, the first included; < steps when every
    row stopped early)."""

    tokens: jax.Array
    lengths: jax.Array
    stopped: jax.Array
    steps_run: jax.Array


def decode(model: Transformer, cache: Cache, first: jax.Array, pads: jax.Array, prompt_len: int, steps: int,
           key: jax.Array, sampling: Sampling, stop_ids: jax.Array) -> tuple[Decoded, Cache]:
    """Up to `steps` new tokens per row, the first being `first` (from `prefill`), and the final cache: one forward
    pass of one token per step in a `while_loop` (compiled once) that ends when every row has made one of
    `stop_ids` [n] (a value: other ids of the same count reuse the program) or after `steps` tokens. Returning the
    cache lets a caller donate it, so the loop updates it in place instead of in a copy."""
    batch = first.shape[0]
    out = jnp.zeros((batch, steps), jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, stop_ids)
    graphdef, state = nnx.split(model)

    def going(carry):
        i, _, done, _, _ = carry
        return (i < steps) & ~jnp.all(done)

    def step(carry):
        i, out, done, lengths, cache = carry
        previous = jax.lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1)  # [batch, 1], at slot prompt_len + i - 1
        logits, cache = forward_cached(nnx.merge(graphdef, state), previous, pads, prompt_len + i - 1, cache)
        token = choose(logits[:, 0], jax.random.fold_in(key, i), sampling)
        # A finished row keeps stepping with the others (one program for the batch); what it makes is not its own.
        lengths = jnp.where(done, lengths, i + 1)
        done = done | jnp.isin(token, stop_ids)
        return i + 1, jax.lax.dynamic_update_slice_in_dim(out, token[:, None], i, axis=1), done, lengths, cache

    start = (jnp.int32(1), out, done, jnp.ones((batch,), jnp.int32), cache)
    steps_run, out, done, lengths, cache = jax.lax.while_loop(going, step, start)
    return Decoded(out, lengths, done, steps_run), cache


"""Mixture-of-experts routing as pure functions: scores, top-k, capacity, slot order and router losses.

Nothing here knows about meshes or devices: each function sees one group of tokens (or
any leading batch shape, where noted) and is used unchanged inside and outside shard_map.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(logits: jax.Array, k: int, score: str = "softmax") -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k routing of logits [..., E] -> (expert indices [..., k] int32, gates [..., k], scores [..., E]).

    Runs in fp32. Scores are softmax (or sigmoid) of the logits; the k best experts are taken
    in order of score (ties go to the lower expert index), and
    their scores are renormalised so each token's gates sum to 1.
    """
    logits = logits.astype(jnp.float32)
    if score == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    elif score == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        raise ValueError(f"router score {score!r} is not one of: softmax, sigmoid")
    # k rounds of argmax rather than lax.top_k: XLA:CPU's partitioner gathers the whole batch
    # for a top_k (TPU's does not), while argmax stays split along the tokens everywhere.
    idx = []
    masked = scores
    for _ in range(k):
        best = jnp.argmax(masked, axis=-1)
        idx.append(best)
        masked = jnp.where(jax.nn.one_hot(best, masked.shape[-1], dtype=bool), -jnp.inf, masked)
    idx = jnp.stack(idx, axis=-1)
    top = jnp.take_along_axis(scores, idx, axis=-1)
    if k == 1:
        # top / top is exactly 1: say so, rather than pass rounding noise back into the router
        # (which, with one expert per token, learns from the router losses alone).
        gates = jnp.ones_like(top)
    else:
        gates = top / jnp.sum(top, axis=-1, keepdims=True)
    return idx.astype(jnp.int32), gates, scores


def slot_positions(expert_idx: jax.Array, num_experts: int) -> jax.Array:
    """Each assignment's position in its expert's queue, for one group: [T, k] -> [T, k] int32.

    Queues fill choice-major: every token's first choice in token order, then every token's
    second choice, and so on, so when an expert overflows its later (lower-ranked) choices
    are dropped first. An assignment whose position is >= capacity is dropped.
    """
    tokens, k = expert_idx.shape
    choice_major = expert_idx.T.reshape(-1)  # [k*T]: choice 0 of every token, then choice 1, ...
    onehot = jax.nn.one_hot(choice_major, num_experts, dtype=jnp.int32)
    before = jnp.cumsum(onehot, axis=0) - onehot  # assignments to the same expert queued earlier
    pos = jnp.take_along_axis(before, choice_major[:, None], axis=1)[:, 0]
    return pos.reshape(k, tokens).T


def expert_counts(expert_idx: jax.Array, num_experts: int) -> jax.Array:
    """Routed (token, choice) assignments per expert, before any dropping: [..., k] -> [E] int32."""
    # Indexed in its own shape, not flattened: flattening [batch, length] split over two mesh axes
    # (batch axes and `sequence`) would make the compiler gather the length first.
    return jnp.zeros((num_experts,), jnp.int32).at[expert_idx].add(1)


def aux_loss(scores: jax.Array, expert_idx: jax.Array, fraction: jax.Array | None = None) -> jax.Array:
    """Switch/GShard load-balancing loss E * sum_i f_i * p_i over all tokens ([..., E], [..., k]).

    f_i is the fraction of tokens that chose expert i among their k choices (assignments to i
    before dropping, divided by the number of tokens, so sum_i f_i = k) and p_i the mean
    router probability of expert i (scores renormalised per token, a no-op for softmax). It
    equals k under perfectly uniform routing and grows with imbalance; only p carries gradient.
    `fraction` overrides f (e.g. measured over more tokens than these: since f carries no
    gradient and the loss is linear in p, the mean of per-replica losses with the global f is
    exactly the global loss).
    """
    num_experts = scores.shape[-1]
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    if fraction is None:
        fraction = expert_counts(expert_idx, num_experts).astype(jnp.float32) / (scores.size // num_experts)
    f = fraction
    return num_experts * jnp.sum(f * jnp.mean(probs, axis=tuple(range(probs.ndim - 1))))


def z_loss(logits: jax.Array) -> jax.Array:
    """Router z-loss: mean over tokens of logsumexp(logits)^2 (ST-MoE), in fp32."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)))

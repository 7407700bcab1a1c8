"""Mixture-of-experts routing as pure functions: scores, top-k, capacity, slot order and router losses.

Nothing here knows about meshes or devices: each function sees one group of tokens (or
any leading batch shape, where noted) and is used unchanged inside and outside shard_map.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(logits: jax.Array, k: int, score: str = "softmax", *, bias: jax.Array | None = None, norm: bool = True,
          scaling: float = 1.0, n_group: int = 1, topk_group: int = 1,
          group_score: str = "top2_sum") -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k routing of logits [..., E] -> (expert indices [..., k] int32, gates [..., k], scores [..., E]).

    Runs in fp32. Scores are softmax (or sigmoid) of the logits. Selection ranks `scores + bias`
    (`bias` [E]: auxiliary-loss-free balancing, DeepSeek-V3; it steers which experts are chosen
    and never their weight), first keeping each token's `topk_group` best of `n_group` equal
    groups of experts (a group ranks by the sum of its two best biased scores, `group_score="top2_sum"`
    as DeepSeek-V3's, or by its best one, `"max"` as DeepSeek-V2's), then taking the k
    best experts of those in order (ties go to the lower expert index). Gates are the chosen
    experts' unbiased scores, renormalised to sum to 1 when `norm`, then times `scaling`
    (DeepSeek-V3's routed_scaling_factor).
    """
    logits = logits.astype(jnp.float32)
    if score == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    elif score == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        raise ValueError(f"router score {score!r} is not one of: softmax, sigmoid")
    # Bias enters selection only: no gradient reaches it, and the gates below read the unbiased scores.
    choice = scores if bias is None else scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
    if topk_group < n_group:
        choice = _keep_best_groups(choice, n_group, topk_group, group_score)
    idx = _top_indices(choice, k)
    top = jnp.take_along_axis(scores, idx, axis=-1)
    if norm and k == 1:
        # top / top is exactly 1: say so, rather than pass rounding noise back into the router
        # (which, with one expert per token, learns from the router losses alone).
        gates = jnp.ones_like(top)
    elif norm:
        gates = top / jnp.sum(top, axis=-1, keepdims=True)
    else:
        gates = top
    return idx.astype(jnp.int32), gates * scaling if scaling != 1.0 else gates, scores


def _top_indices(x: jax.Array, k: int) -> jax.Array:
    """Indices [..., k] of the k largest entries of x [..., n], best first (ties to the lower index)."""
    # k rounds of argmax rather than lax.top_k: XLA:CPU's partitioner gathers the whole batch
    # for a top_k (TPU's does not), while argmax stays split along the tokens everywhere.
    idx = []
    for _ in range(k):
        best = jnp.argmax(x, axis=-1)
        idx.append(best)
        x = jnp.where(jax.nn.one_hot(best, x.shape[-1], dtype=bool), -jnp.inf, x)
    return jnp.stack(idx, axis=-1)


def _keep_best_groups(choice: jax.Array, n_group: int, topk_group: int, group_score: str) -> jax.Array:
    """`choice` [..., E] with the experts outside each token's `topk_group` best groups set to -inf.

    A group's rank is the sum of its two best scores (one when a group holds a single expert; "top2_sum",
    DeepSeek-V3's) or its best score ("max", DeepSeek-V2's).
    """
    *lead, num_experts = choice.shape
    grouped = choice.reshape(*lead, n_group, num_experts // n_group)
    if group_score == "max":
        rank = jnp.max(grouped, axis=-1)
    elif group_score == "top2_sum":
        rank = jnp.sum(jnp.take_along_axis(grouped, _top_indices(grouped, min(2, grouped.shape[-1])), axis=-1), -1)
    else:
        raise ValueError(f"group score {group_score!r} is not one of: top2_sum, max")
    groups = _top_indices(rank, topk_group)  # [..., topk_group]
    keep = jnp.any(jax.nn.one_hot(groups, n_group, dtype=bool), axis=-2)  # [..., n_group]
    return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(choice.shape)


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


def sequence_aux_loss(scores: jax.Array, expert_idx: jax.Array) -> jax.Array:
    """DeepSeek-V3's sequence-wise balance loss over [batch, length, E] scores and [batch, length, k] choices.

    Per sequence: (E / k) * sum_i f_i * p_i, with f_i the share of the sequence's tokens that chose
    expert i (sum_i f_i = k) and p_i its mean score renormalised per token; the mean over sequences.
    Exactly 1 when every sequence spreads its choices and scores evenly; only p carries gradient.
    """
    _, length, num_experts = scores.shape
    k = expert_idx.shape[-1]
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    counts = jax.vmap(lambda idx: expert_counts(idx, num_experts))(expert_idx).astype(jnp.float32)  # [batch, E]
    f = counts / length
    return num_experts / k * jnp.mean(jnp.sum(f * jnp.mean(probs, axis=1), axis=-1))

"""Deduplicated expert dispatch (backends.moe=capacity_dedup): each token crosses the `expert` axis once per device.

The capacity path sends one row per (token, choice): k rows per token, E x C slots per group whatever the routing.
Here a token goes once to each device that holds any of its experts, with its choices there (local expert index
and gate), into `device_capacity` rows per destination; the receiving device queues those choices into its own
experts' slots (as the capacity path does, over every source's rows), runs them, sums each row's gated outputs and
sends one row back. With k choices over devices holding E / ways experts each, a token reaches at most
min(k, ways) devices, and under group-limited routing (DeepSeek-V3's node-limited routing) at most the devices its
topk_group groups cover (`ops.capacity.devices_reached`): the all-to-all moves that many rows per token, not k.

Every buffer is indexed by slot (gathers and scatter-adds), so nothing of size tokens x k x d_model is formed.
Drops: a token whose device queue is full (token order) is not sent there; a choice whose local expert queue is
full (choice-major, as `ops.routing.slot_positions`) is not run. `kept` reports both per choice.

Details: docs/moe.md#deduplicated-dispatch
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spmd_train.ops.experts import batched_swiglu
from spmd_train.ops.routing import slot_positions


def dedup_slots_and_experts(x, expert_idx, gates, weights, num_experts, device_slots, slots, dtype, axis, prepare,
                            limit):
    """Groups [G, T, d] (+ [G, T, k] routing) -> ([G, T, d], kept [G, T, k]), exchanging over `axis`.

    `device_slots`: rows per destination device and group; `slots`: per local expert, over all received rows.
    """
    groups, tokens, d = x.shape
    k = expert_idx.shape[-1]
    ways = jax.lax.axis_size(axis)
    per = num_experts // ways
    device = expert_idx // per  # [G, T, k]
    on = device[..., None] == jnp.arange(ways)  # [G, T, k, W]: choice j lies on device w
    hit = jnp.any(on, axis=2)  # [G, T, W]
    pos = jnp.cumsum(hit, axis=1, dtype=jnp.int32) - 1  # the token's place in device w's queue, in token order
    sent = hit & (pos < device_slots)
    rows = ways * device_slots
    flat = jnp.where(sent, jnp.arange(ways) * device_slots + pos, rows)  # [G, T, W]; `rows`: not sent
    # Which token fills each send row (`tokens`: none), then the rows themselves by gather.
    token_of = jax.vmap(lambda f: jnp.full((rows,), tokens, jnp.int32).at[f.reshape(-1)].set(
        jnp.repeat(jnp.arange(tokens, dtype=jnp.int32), ways), mode="drop"))(flat)  # [G, rows]
    padded = jnp.concatenate([x.astype(dtype), jnp.zeros((groups, 1, d), dtype)], axis=1)
    send = jnp.take_along_axis(padded, token_of[..., None], axis=1)  # [G, rows, d]
    # Each row's choices on its destination: the local expert (`per`: another device's) and the gate (0 there).
    row_device = jnp.arange(rows) // device_slots  # [rows]
    safe = jnp.minimum(token_of, tokens - 1)
    row_idx = jnp.take_along_axis(expert_idx, safe[..., None], axis=1)  # [G, rows, k]
    row_gates = jnp.take_along_axis(gates, safe[..., None], axis=1)
    here = (row_idx // per == row_device[:, None]) & (token_of < tokens)[..., None]
    local_idx = jnp.where(here, row_idx % per, per)
    local_gates = jnp.where(here, row_gates, 0.0).astype(jnp.float32)

    def exchange(a):  # [G, rows, ...] by destination -> by source, and back (the same permutation)
        shape = a.shape
        a = a.reshape(groups, ways, device_slots, *shape[2:])
        return jax.lax.all_to_all(a, axis, 1, 1, tiled=True).reshape(shape)

    got, got_idx, got_gates = exchange(send), exchange(local_idx), exchange(local_gates)
    source, ran_here = jax.vmap(lambda i: _local_slots(i, per, slots))(got_idx)  # [G, per*slots], [G, rows, k]
    buf = jax.vmap(lambda r, s: jnp.concatenate([r, jnp.zeros((1, d), r.dtype)])[jnp.minimum(s // k, rows)])(
        got, source)
    out = batched_swiglu(buf.reshape(groups, per, slots, d), weights, dtype, prepare, limit)
    out = out.reshape(groups, per * slots, d).astype(jnp.float32)
    # Each received row's gated sum over its local experts, by scatter-add from the slots.
    gate = jax.vmap(lambda g, s: jnp.concatenate([g.reshape(-1), jnp.zeros((1,), jnp.float32)])[s])(got_gates, source)
    summed = jax.vmap(lambda o, g, s: jnp.zeros((rows + 1, d), jnp.float32).at[s // k].add(o * g[:, None]))(
        out, gate, source)[:, :rows]
    back, ran_back = exchange(summed.astype(dtype)), exchange(ran_here.astype(jnp.int8)) > 0  # [G, rows, d], [.., k]
    # Each token's rows summed (gated already), by scatter-add from the rows.
    y = jax.vmap(lambda t, b: jnp.zeros((tokens + 1, d), jnp.float32).at[t].add(b.astype(jnp.float32)))(
        token_of, back)[:, :tokens]
    # A choice ran when its token reached the choice's device and the queue of its expert there had room.
    choice_row = jnp.take_along_axis(flat, device, axis=2)  # [G, T, k]: the row that carried choice j
    flags = jnp.concatenate([ran_back, jnp.zeros((groups, 1, k), bool)], axis=1).reshape(groups, -1)
    kept = jnp.take_along_axis(flags, (choice_row * k + jnp.arange(k)).reshape(groups, -1), axis=1)
    return y.astype(x.dtype), kept.reshape(groups, tokens, k)


def _local_slots(idx: jax.Array, per: int, slots: int) -> tuple[jax.Array, jax.Array]:
    """One group's received choices [R, k] (local expert, or `per`: another device's) -> (the (row, choice) that fills
    each local expert slot [per * slots] (R * k: none), which choices run [R, k])."""
    n, k = idx.shape
    pos = slot_positions(idx, per + 1)  # the phantom expert `per` queues the choices that are not here
    ran = (idx < per) & (pos < slots)
    slot = jnp.where(ran, idx * slots + pos, per * slots).reshape(n * k)
    source = jnp.full((per * slots,), n * k, jnp.int32).at[slot].set(jnp.arange(n * k, dtype=jnp.int32),
                                                                       mode="drop")
    return source, ran

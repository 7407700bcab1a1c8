"""Expert parallelism: send each token to its experts' devices, run them, bring the results back.

Three implementations: capacity (default; fixed slots per expert, two `all_to_all`s over `expert`, overflow
dropped), capacity_dedup (each token sent once per device holding its experts: `parallel.expert_dedup`) and
dropless (`ragged_all_to_all` and `ragged_dot`, nothing dropped). With mesh.expert > 1 all run in a `shard_map`
manual over every mesh axis (`_in_region` says why). A group, the unit capacity is counted over, is the tokens one
device holds of the batch.

Details: docs/moe.md#expert-parallelism-the-capacity-path and docs/moe.md#the-dropless-path
"""

from __future__ import annotations

import math
from typing import get_args

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd_train.config.model_schema import MoEImpl
from spmd_train.config.validity import expert_divides_experts, refuse
from spmd_train.errors import ConfigError
from spmd_train.ops.capacity import capacity, device_capacity
from spmd_train.ops.experts import ExpertWeights, Prepare, batched_swiglu, ragged_swiglu, run_of_rows
from spmd_train.ops.routing import expert_counts, slot_positions
from spmd_train.parallel.expert_dedup import dedup_slots_and_experts
from spmd_train.sharding.arithmetic import entry_axes, manual_axes
from spmd_train.sharding.constrain import active_layout, constrain, stored_param

AXIS = "expert"
IMPLEMENTATIONS = get_args(MoEImpl)


def moe_ffn(x: jax.Array, expert_idx: jax.Array, gates: jax.Array, weights: ExpertWeights, *, num_experts: int,
            capacity_factor: float, impl: str = "capacity", dtype=jnp.float32,
            limit: float | None = None, groups: tuple[int, int] = (1, 1)) -> tuple[jax.Array, jax.Array]:
    """Routed experts: x [b, l, d], expert_idx/gates [b, l, k] -> (y [b, l, d] in x.dtype, kept [b, l, k] bool).

    `weights` are the stored expert weights (leading `experts` axis; biases optional); `limit` makes the
    activation gpt-oss's clamped SwiGLU (`ops.experts.activate`); `kept` is False for assignments dropped for
    lack of capacity (always True when dropless). `groups`: the routing's (n_group, topk_group), which bounds the
    devices a token reaches under capacity_dedup (`ops.capacity.device_capacity`).
    """
    layout = active_layout()
    manual = manual_axes()
    mesh = None if layout is None else jax.sharding.get_abstract_mesh() if manual else layout.mesh
    if AXIS in manual:
        raise NotImplementedError("an MoE layer inside a shard_map that is already manual over `expert`")
    axes, length = _batch_axes(layout, manual), _length_axes(layout, manual)
    ways = 1 if mesh is None else mesh.shape[AXIS]
    if ways > 1 and AXIS not in axes:
        raise ConfigError(f"mesh.expert={ways} needs `expert` among the mesh axes of the activation rule `batch` "
                          f"(now {list(axes)}): each expert-axis device dispatches its own tokens")
    refuse(expert_divides_experts(num_experts, ways))
    if impl in ("capacity", "capacity_dedup"):
        dedup = groups if impl == "capacity_dedup" and ways > 1 else None  # one device: nothing to deduplicate
        return _capacity(x, expert_idx, gates, weights, num_experts, capacity_factor, dtype, layout, mesh, axes,
                         length, ways, limit, dedup)
    if impl == "dropless":
        return _dropless(x, expert_idx, gates, weights, num_experts, dtype, layout, mesh, axes, length, ways, limit)
    raise ValueError(f"backends.moe={impl!r} is not an implementation (valid: {', '.join(IMPLEMENTATIONS)})")


def replica_mean(x: jax.Array) -> jax.Array:
    """Mean of a per-device statistic over the batch axes an enclosing shard_map made manual.

    The train step runs replicas (`data`, and `fsdp` below ZeRO stage 2) in a manual region,
    where each sees only its tokens; router fractions averaged there equal those of the
    global batch. Outside any manual region the statistic is already global.
    """
    layout = active_layout()
    manual = manual_axes()
    if layout is None or not manual:
        return x
    axes = tuple(a for a in entry_axes(layout.activation_spec(P("batch")), 0) if a in manual)
    return jax.lax.pmean(x, axes) if axes else x


# --- capacity: fixed slots, two all-to-alls ---------------------------------------------------------


def _capacity(x, expert_idx, gates, weights, num_experts, capacity_factor, dtype, layout, mesh, axes, length, ways,
              limit, dedup=None):
    b, l, d = x.shape
    k = expert_idx.shape[-1]
    rows = b // math.prod(mesh.shape[a] for a in axes) if axes else b
    tokens = rows * l // math.prod(mesh.shape[a] for a in length) if length else rows * l
    slots = capacity(k, tokens, capacity_factor, num_experts)
    if dedup is not None:  # rows per destination device; each local expert's slots over every source's rows
        device_slots = device_capacity(k, tokens, capacity_factor, ways, num_experts, *dedup)
        slots = capacity(k, tokens * ways, capacity_factor, num_experts)
    # A length split over `sequence` cannot be folded into a group dimension without moving tokens:
    # then each device forms its group by hand, in the region, even without exchange.
    region = ways > 1 or bool(length)

    def local(xs, idx, gs, w, prepare=None):
        held = xs.shape[0] * xs.shape[1] // tokens  # every group outside a region; one inside
        pin = (lambda a: _pin(a, P(axes, P.UNCONSTRAINED, None), mesh)) if axes and not region else (lambda a: a)
        if dedup is not None:
            y, kept = dedup_slots_and_experts(xs.reshape(held, tokens, d), idx.reshape(held, tokens, k),
                                              gs.reshape(held, tokens, k), w, num_experts, device_slots, slots, dtype,
                                              AXIS, prepare or _COMPILER_PARTITIONED, limit)
            return y.reshape(xs.shape), kept.reshape(idx.shape)
        y, kept = _slots_and_experts(pin(xs.reshape(held, tokens, d)), pin(idx.reshape(held, tokens, k)),
                                     pin(gs.reshape(held, tokens, k)), w, num_experts, slots, dtype,
                                     AXIS if ways > 1 else None, prepare or _COMPILER_PARTITIONED, limit)
        return y.reshape(xs.shape), kept.reshape(idx.shape)

    if not region:  # no exchange: the compiler partitions the groups like any batch dimension
        return local(x, expert_idx, gates, weights)
    return _in_region(local, layout, mesh, axes, length, (x, expert_idx, gates), weights, outputs=2)


def _slots_and_experts(x, expert_idx, gates, weights, num_experts, slots, dtype, axis, prepare, limit):
    """Groups [G, T, d] (+ [G, T, k] routing) -> ([G, T, d], kept [G, T, k]) through [E, C, d] slots."""
    groups, tokens, d = x.shape
    k = expert_idx.shape[-1]
    pos = jax.vmap(slot_positions, in_axes=(0, None))(expert_idx, num_experts)
    kept = pos < slots
    # Flat slot of each assignment; a dropped one points past the end, where scatter and gather ignore it.
    slot = jnp.where(kept, expert_idx * slots + pos, num_experts * slots).reshape(groups, tokens * k)
    src = jnp.broadcast_to(x[:, :, None, :].astype(dtype), (groups, tokens, k, d)).reshape(groups, tokens * k, d)
    buf = jax.vmap(lambda s, v: jnp.zeros((num_experts * slots, d), dtype).at[s].add(v, mode="drop"))(slot, src)
    buf = buf.reshape(groups, num_experts, slots, d)
    if axis is None:
        out = batched_swiglu(buf, weights, dtype, prepare, limit)
    else:
        ways = jax.lax.axis_size(axis)
        buf = buf.reshape(groups, ways, num_experts // ways, slots, d)
        # [G, destination device, local expert, C, d] -> [G, source device, local expert, C, d] and back.
        buf = jax.lax.all_to_all(buf, axis, 1, 1, tiled=True)
        out = jax.lax.all_to_all(batched_swiglu(buf, weights, dtype, prepare, limit), axis, 1, 1, tiled=True)
    out = out.reshape(groups, num_experts * slots, d)
    back = jax.vmap(lambda o, s: o.at[s].get(mode="fill", fill_value=0))(out, slot).reshape(groups, tokens, k, d)
    y = jnp.einsum("gtkd,gtk->gtd", back.astype(jnp.float32), jnp.where(kept, gates, 0.0).astype(jnp.float32))
    return y.astype(x.dtype), kept


# --- dropless: ragged all-to-all and ragged_dot ----------------------------------------------------


def _dropless(x, expert_idx, gates, weights, num_experts, dtype, layout, mesh, axes, length, ways, limit):
    _b, _l, d = x.shape
    k = expert_idx.shape[-1]

    def local(xs, idx, gs, w, prepare=None):
        n = xs.shape[0] * xs.shape[1]
        y = _ragged_experts(xs.reshape(n, d), idx.reshape(n, k), gs.reshape(n, k), w, num_experts, dtype,
                            AXIS if ways > 1 else None, prepare or _COMPILER_PARTITIONED, (*axes, *length), limit)
        return (y.reshape(xs.shape),)

    if not axes and not length:
        (y,) = local(x, expert_idx, gates, weights)
    else:  # even without exchange: the compiler would gather every token to sort them
        (y,) = _in_region(local, layout, mesh, axes, length, (x, expert_idx, gates), weights, outputs=1)
    return y, jnp.ones(expert_idx.shape, bool)


def _ragged_experts(x, expert_idx, gates, weights, num_experts, dtype, axis, prepare, token_axes, limit):
    """One device's tokens x [T, d] -> [T, d]: sort assignments by expert, (exchange,) ragged_dot, undo."""
    tokens, k = expert_idx.shape
    n = tokens * k
    order = jnp.argsort(expert_idx.reshape(n), stable=True)
    xs = jnp.take(x, order // k, axis=0).astype(dtype)
    counts = expert_counts(expert_idx, num_experts)
    if axis is None:
        out = ragged_swiglu(xs, counts, weights, dtype, prepare, limit)
    else:
        out = _exchange_and_run(xs, counts, weights, num_experts, dtype, axis, prepare, token_axes, limit)
    per_assignment = jnp.zeros_like(out).at[order].set(out)
    y = jnp.einsum("tkd,tk->td", per_assignment.reshape(tokens, k, -1).astype(jnp.float32), gates)
    return y.astype(x.dtype)


def _exchange_and_run(xs, counts, weights, num_experts, dtype, axis, prepare, token_axes, limit):
    """Sorted assignments [n, d] -> expert outputs in the same order, via the devices owning the experts.

    ragged_all_to_all's result takes the type of its `output` buffer, so the zero buffers are
    marked varying over the token axes by hand: left invariant, autodiff would psum the received
    rows' gradient over the expert axis (wrong, and silent).
    """
    n, d = xs.shape
    ways, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    local_experts = num_experts // ways
    per = jax.lax.all_gather(counts, axis).reshape(ways, ways, local_experts)  # [source, destination, expert]
    sizes = per.sum(-1)  # rows each source sends each destination
    send, recv = sizes[me], sizes[:, me]
    # Worst case every device sends every assignment to this one: dropless costs a ways-fold buffer.
    buf = jax.lax.pcast(jnp.zeros((ways * n, d), xs.dtype), token_axes, to="varying")
    got = jax.lax.ragged_all_to_all(xs, buf, _exclusive_cumsum(send), send, _exclusive_cumsum(sizes, 0)[me], recv,
                                    axis_name=axis)
    # Received: per source, rows sorted by local expert. Regroup by local expert for ragged_dot;
    # rows past the received ones get label `local_experts` and sort last.
    mine = per[:, me, :]
    segment = run_of_rows(mine.reshape(-1), ways * n)  # each row's (source, expert) run
    label = jnp.where(segment < ways * local_experts, segment % local_experts, local_experts)
    regroup = jnp.argsort(label, stable=True)
    out = ragged_swiglu(got[regroup], mine.sum(0), weights, dtype, prepare, limit)
    out = jnp.zeros_like(out).at[regroup].set(out)
    home = jax.lax.pcast(jnp.zeros((n, d), out.dtype), token_axes, to="varying")
    return jax.lax.ragged_all_to_all(out, home, _exclusive_cumsum(recv), recv, _exclusive_cumsum(sizes, 1)[:, me],
                                     send, axis_name=axis)


# --- the shard_map region ---------------------------------------------------------------------------


def _in_region(local, layout, mesh, axes, length, activations, weights: ExpertWeights, outputs: int):
    """Run `local` per device in a shard_map manual over every mesh axis not already manual.

    Why not manual over `expert` alone: XLA replicates the operand of a collective in a partly
    manual region over its compiler-partitioned axes (measured: an all-gather over fsdp before
    each all-to-all, and over tensor before each by-hand weight gather). So each device owns
    its group of tokens outright (rows split over the batch axes, the length over `length`,
    i.e. `sequence` under context parallelism), and the experts' hidden width
    (`expert_mlp`, on `tensor`) is split by hand, Megatron-style, with one psum after the
    down projection. Weights enter with `embed` still split as stored and are gathered inside
    each matmul's checkpoint (the backward pass gathers again and reduce-scatters the
    gradient, as ZeRO-3 does; stored over fsdp x sequence, they are gathered over both). Any
    other axis only replicates the work.
    """
    outer = manual_axes()
    hidden = tuple(a for a in entry_axes(layout.activation_spec(P("expert_mlp")), 0)
                   if a not in axes and a not in length and a not in outer)
    manual = set(axes) | set(length) | set(hidden)

    def weight_spec(names):
        stored = layout.param_spec(P(*names), None, fsdp=layout.zero_stage >= 3)
        entries = []
        for dim, name in enumerate(names):
            if name == "experts":
                entries.append(AXIS if AXIS in manual else None)
            elif name == "expert_mlp":
                entries.append(hidden or None)
            else:
                kept = tuple(a for a in entry_axes(stored, dim) if a in manual and a != AXIS and a not in hidden)
                entries.append(kept or None)
        return P(*entries)

    names_of = weights.axes()
    specs = {names: weight_spec(names) for names in names_of if names is not None}

    def gather(w, names):
        for dim, name in enumerate(names):
            if name not in ("experts", "expert_mlp") and specs[names][dim] is not None:
                w = jax.lax.all_gather(w, specs[names][dim], axis=dim, tiled=True)
        return w

    by_hand = Prepare(lambda w, names, dtype: constrain(gather(stored_param(w, names).astype(dtype), names), names),
                      (lambda y: jax.lax.psum(y, hidden)) if hidden else (lambda y: y))
    spec = P(axes or None, length or None)
    w_specs = ExpertWeights(*(specs[names] for names in names_of if names is not None))
    # Every other axis is manual too (replicated: size 1 today): XLA:CPU aborts on a bf16 psum or
    # psum_scatter in a partly manual region ("Invalid binary instruction opcode copy").
    return jax.shard_map(lambda x, i, g, w: local(x, i, g, w, by_hand), mesh=mesh,
                         in_specs=(spec, spec, spec, w_specs), out_specs=(spec,) * outputs,
                         axis_names=set(mesh.axis_names) - outer, check_vma=True)(*activations, weights)


# --- helpers ---------------------------------------------------------------------------------------


# Outside a region: the weight pinned to its stored layout (and its gradient to the gradient
# layout), cast (bf16 compute gathers bf16), then laid out for compute by the compiler.
_COMPILER_PARTITIONED = Prepare(lambda w, names, dtype: constrain(stored_param(w, names).astype(dtype), names),
                                lambda y: y)


def _exclusive_cumsum(a: jax.Array, axis: int = 0) -> jax.Array:
    return jnp.cumsum(a, axis=axis) - a


def _batch_axes(layout, manual: set[str]) -> tuple[str, ...]:
    """Mesh axes (size > 1, not already manual) that split the batch, outermost first."""
    if layout is None:
        return ()
    return tuple(a for a in entry_axes(layout.activation_spec(P("batch")), 0) if a not in manual)


def _length_axes(layout, manual: set[str]) -> tuple[str, ...]:
    """Mesh axes (size > 1, not already manual) that split the tokens' length: `sequence` under context parallelism."""
    if layout is None:
        return ()
    return tuple(a for a in entry_axes(layout.activation_spec(P(None, "length")), 1) if a not in manual)


def _pin(x: jax.Array, spec: P, mesh) -> jax.Array:
    if manual_axes():  # inside a shard_map: the context mesh applies, minus its manual axes
        return jax.lax.with_sharding_constraint(x, spec)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

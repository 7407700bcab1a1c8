"""The pipeline executor: a schedule table run as one SPMD program over the `pipeline` axis.

`run_pipeline` is a `shard_map` manual over `pipeline` only; each tick every stage runs nothing, one forward or
one backward, and `lax.ppermute` moves outputs and input gradients to the neighbouring stages. Each backward
rebuilds its microbatch's VJP from a stash slot, so a stage holds exactly the residuals the schedule keeps in
flight. This module knows mesh axis names and pure functions; what a stage computes is the caller's.

Derivation: docs/explanation/pipeline-executor.md#the-executor
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from spmd_train.ops.vjp_residuals import rebuild_vjp, split_residuals
from spmd_train.parallel.pipeline_plan import FIELDS, PipelinePlan
from spmd_train.parallel.pipeline_split import head_on_last_chunk, run_split_ticks

AXIS = "pipeline"

StageFn = Callable[..., Any]
"""(one chunk's stacked layer parameters [layers_per_chunk, ...], x[, context]) -> y, same shape as x; `context`
is the microbatch's slice of run_pipeline's `context`, when one is given (not differentiated). With
`extras=True`: -> (y, loss term (a scalar added to that microbatch's loss), statistics (a pytree whose leaves
have the chunk's layers on axis 0))."""
HeadFn = Callable[[Any, jax.Array, Any], jax.Array]
"""(head parameters, last chunk's output, the microbatch's targets) -> scalar loss of that microbatch."""


def run_pipeline(stage_fn: StageFn, head_fn: HeadFn, plan: PipelinePlan, blocks: Any, head: Any, inputs: jax.Array,
                 targets: Any, *, context: Any = None, mesh: jax.sharding.Mesh | None = None,
                 extras: bool = False, chunk_rows: Any = None, chunk_kinds: Any = None,
                 loss_scale: jax.Array | None = None) -> tuple:
    """Loss and gradients of the mean over microbatches of head_fn(stages(inputs[i]), targets[i]).

    `blocks` has the layers stacked on axis 0 in storage order (split over `pipeline`: device d
    holds its `virtual` chunks one after another), `head` is replicated over `pipeline`,
    `inputs` is [microbatches, ...] (the embedded microbatches), `targets` has a leading
    microbatch axis, and so does `context` (e.g. each microbatch's document segments), which every
    stage passes to `stage_fn` with the microbatch it runs. Returns (loss, d loss / d blocks,
    d loss / d head, d loss / d inputs), and with `extras` the stages' statistics, each leaf the mean over
    microbatches with the whole stack's units in storage order on axis 0 (the loss terms count in the gradients;
    the returned loss is the heads' alone).
    `mesh` is the device mesh (default: the one set with `jax.set_mesh`); inside another
    shard_map the enclosing abstract mesh is used. `chunk_rows` [stages, virtual] (uneven stages): how many leading
    rows of each stored chunk are layers, passed to stage_fn as `rows=` (the rest of the chunk is padding).
    `chunk_kinds` [stages, virtual, rows per chunk, ...]: the attention kind of each stored row's layers, passed to
    stage_fn as `kinds=` (models mixing full and sliding layers). `loss_scale` (a float32 scalar): every
    microbatch's backward starts from the scale instead of 1 (a dynamic loss scale's), so the gradients come back
    multiplied by it and the loss does not.
    """
    sched = plan.schedule
    p, v, m = sched.stages, sched.virtual, sched.microbatches
    if inputs.shape[0] != m:
        raise ValueError(f"inputs has {inputs.shape[0]} microbatches, the schedule {m}")
    rows = jnp.asarray(plan.rows)
    col = {name: i for i, name in enumerate(FIELDS)}  # split-backward plans: their own columns, pipeline_split
    tables = {name: table for name, table in (("rows", chunk_rows), ("kinds", chunk_kinds)) if table is not None}
    if chunk_rows is not None and sched.split_backward:
        raise ValueError(f"uneven chunks (chunk_rows) need a fused schedule, not {sched.name}")
    run_stage = executor_stage(stage_fn, has_context=context is not None, extras=extras, chunk_keys=tuple(tables))
    context = () if context is None else context
    # The loss term's cotangent: it enters the mean over microbatches like each microbatch's loss.
    term_ct = jnp.asarray(1 / m, jnp.float32) if loss_scale is None else loss_scale.astype(jnp.float32) / m

    def local(blocks, head, inputs, targets, context):
        stage = jax.lax.axis_index(AXIS)
        # Device d holds rows [d*L/p, (d+1)*L/p) of the stack: its v chunks, in order.
        chunks = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), blocks)
        chunk_params = lambda k: jax.tree.map(lambda a: a[k], chunks)
        x_like = jnp.zeros(inputs.shape[1:], inputs.dtype)
        of_microbatch = lambda tree, mb: jax.tree.map(lambda a: a[mb], tree)
        # What a chunk's stage function gets beside (params, x): the microbatch's context, and the chunk's rows of
        # the tables (with uneven stages the number of its stored rows that are layers, with mixed layers their kinds).
        arrays = {name: jnp.asarray(table, jnp.int32) for name, table in tables.items()}
        if arrays:
            chunk_context = lambda mb, k: ({n: a[stage, k] for n, a in arrays.items()}, of_microbatch(context, mb))
        else:
            chunk_context = lambda mb, k: of_microbatch(context, mb)
        vjp_layout = _VjpLayout.of(run_stage, chunk_params(0), x_like, chunk_context(0, 0))
        stats = jax.tree.map(lambda a: jnp.zeros((v, *a.shape), a.dtype), vjp_layout.stats)
        if sched.split_backward:
            grads, head_grads, loss, d_inputs, stats = run_split_ticks(plan, run_stage, head_fn, chunks, head, inputs,
                                                                       targets, chunk_context, vjp_layout, stats,
                                                                       loss_scale)
            return _finish(grads, head_grads, loss, d_inputs, stats, m)

        acts = jnp.zeros((plan.act_slots + 1, *x_like.shape), x_like.dtype)  # + 1: the spare slot
        cts = jnp.zeros((plan.ct_slots + 1, *x_like.shape), x_like.dtype)
        stash = [jnp.zeros((plan.stash_slots, *a.shape), a.dtype) for a in vjp_layout.stashed]
        grads = jax.tree.map(jnp.zeros_like, chunks)
        head_grads = jax.tree.map(jnp.zeros_like, head)
        carry = (acts, cts, stash, grads, head_grads, jnp.zeros((), jnp.float32), jnp.zeros_like(inputs), stats)

        def forward(carry, row):
            acts, cts, stash, grads, head_grads, loss, d_inputs, stats = carry
            mb, k, slot = row[col["microbatch"]], row[col["chunk"]], row[col["stash"]]
            read = row[col["read"]]
            x = jnp.where(read < 0, inputs[mb], acts[read])
            params = chunk_params(k)
            ctx = chunk_context(mb, k)
            (y, _), vjp, stats_mb = jax.vjp(lambda params, x: run_stage(params, x, ctx), params, x, has_aux=True)
            stats = jax.tree.map(lambda acc, s: acc.at[k].add(s), stats, stats_mb)
            stash = [buf.at[slot].set(r) for buf, r in zip(stash, vjp_layout.residuals(vjp, params), strict=True)]
            is_last = (stage == p - 1) & (k == v - 1)
            loss_mb, g_head, dy = head_on_last_chunk(head_fn, head, y, of_microbatch(targets, mb), m, is_last,
                                                     loss_scale)
            cts = cts.at[row[col["write_ct"]]].set(dy.astype(cts.dtype))
            head_grads = jax.tree.map(jnp.add, head_grads, g_head)
            return (acts, cts, stash, grads, head_grads, loss + loss_mb.astype(jnp.float32), d_inputs, stats), y, x_like

        def backward(carry, row):
            acts, cts, stash, grads, head_grads, loss, d_inputs, stats = carry
            mb, k, slot = row[col["microbatch"]], row[col["chunk"]], row[col["stash"]]
            vjp = vjp_layout.rebuild(chunk_params(k), [buf[slot] for buf in stash])
            g_chunk, dx = vjp((cts[row[col["read"]]], term_ct))
            grads = jax.tree.map(lambda acc, g: acc.at[k].add(g.astype(acc.dtype)), grads, g_chunk)
            first = (stage == 0) & (k == 0)
            d_inputs = d_inputs.at[mb].set(jnp.where(first, dx, d_inputs[mb]))
            return (acts, cts, stash, grads, head_grads, loss, d_inputs, stats), x_like, dx

        def idle(carry, row):
            return carry, x_like, x_like

        def tick(carry, rows_t):
            row = rows_t[stage]
            carry, send_act, send_ct = jax.lax.switch(row[col["kind"]], [idle, forward, backward], carry, row)
            got_act = jax.lax.ppermute(send_act, AXIS, [(i, (i + 1) % p) for i in range(p)])
            got_ct = jax.lax.ppermute(send_ct, AXIS, [(i, (i - 1) % p) for i in range(p)])
            acts, cts, *rest = carry
            acts = acts.at[row[col["recv_act"]]].set(got_act)
            cts = cts.at[row[col["recv_ct"]]].set(got_ct)
            return (acts, cts, *rest), None

        carry, _ = jax.lax.scan(tick, carry, rows)
        _, _, _, grads, head_grads, loss, d_inputs, stats = carry
        return _finish(grads, head_grads, loss, d_inputs, stats, m)

    block_spec = jax.tree.map(lambda _: P(AXIS), blocks)
    rest_spec = lambda tree: jax.tree.map(lambda _: P(), tree)
    abstract = jax.sharding.get_abstract_mesh()
    if not abstract.empty and (abstract.manual_axes or mesh is None):
        mesh = abstract
    out = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(block_spec, rest_spec(head), P(), rest_spec(targets), rest_spec(context)),
        out_specs=(P(), block_spec, rest_spec(head), P(), P(AXIS)),  # P(AXIS): a prefix for every statistic
        axis_names={AXIS},
        check_vma=False,
    )(blocks, head, inputs, targets, context)
    return out if extras else out[:4]


def executor_stage(stage_fn: StageFn, *, has_context: bool = True, extras: bool = False,
                   chunk_keys: tuple[str, ...] = ()) -> Callable:
    """stage_fn as the executor runs it: (params, x, context) -> ((y, loss term), statistics), for `jax.vjp` with
    has_aux (a stage without extras has the loss term 0 and no statistics). With `chunk_keys` the context is
    ({key: the chunk's row of that table}, the microbatch's context) and stage_fn takes the keys as keywords."""

    def run(params, x, context):
        kw = {}
        if chunk_keys:
            kw, context = context
        out = stage_fn(params, x, context, **kw) if has_context else stage_fn(params, x, **kw)
        y, term, stats = out if extras else (out, jnp.zeros((), jnp.float32), {})
        return (y, jnp.asarray(term, jnp.float32)), stats

    return run


def _finish(grads: Any, head_grads: Any, loss: jax.Array, d_inputs: jax.Array, stats: Any, microbatches: int) -> tuple:
    """(loss, grads, head grads, d inputs, statistics) of the whole pipeline from one stage's accumulators."""
    unstack = lambda g: g.reshape(g.shape[0] * g.shape[1], *g.shape[2:])
    grads = jax.tree.map(unstack, grads)
    stats = jax.tree.map(lambda a: unstack(a) / microbatches, stats)
    # The loss and head gradients live on the stage of the last chunk, the input gradients on stage 0.
    # Summed in fp32: exact either way (one stage holds each value), and XLA:CPU cannot
    # compile a bf16 all-reduce inside a partly manual region.
    totals = jax.tree.map(lambda a: a.astype(jnp.float32), (loss, head_grads, d_inputs))
    loss, head_grads, d_inputs = jax.tree.map(lambda t, a: t.astype(a.dtype), jax.lax.psum(totals, AXIS),
                                              (loss, head_grads, d_inputs))
    return loss, grads, head_grads, d_inputs, stats


class _VjpLayout:
    """Which leaves of a stage's VJP are its weights (re-read later) and which must be stashed.

    `jax.vjp` returns a pytree whose leaves are the residuals. Weights that reach the backward
    unchanged (the stacked matmul weights, forwarded through the layer scan) appear as the very
    input arrays; only the other leaves (activations, small derived values) are stashed per
    microbatch. The tree structure comes from one abstract trace and is reused to rebuild the
    VJP from (weights, stash) at backward time.
    """

    def __init__(self, treedef, weight_index: list[int | None], stashed: list[jax.ShapeDtypeStruct], stats: Any):
        self.treedef, self.weight_index, self.stashed, self.stats = treedef, weight_index, stashed, stats

    @classmethod
    def of(cls, stage_fn: Callable, params: Any, x: jax.Array, context: Any = ()) -> _VjpLayout:
        """From one abstract trace of stage_fn(params, x, context) -> (output, statistics)."""
        found = {}

        def trace(params, x, context):
            _, vjp, stats = jax.vjp(lambda params, x: stage_fn(params, x, context), params, x, has_aux=True)
            found["treedef"], found["index"], stashed = split_residuals(vjp, params)
            return stashed, stats

        stashed, stats = jax.eval_shape(trace, params, x, context)
        return cls(found["treedef"], found["index"], stashed, stats)

    def residuals(self, vjp, params: Any) -> list[jax.Array]:
        """The leaves of a VJP of the same stage function, on `params`, that must be stashed."""
        _, index, stashed = split_residuals(vjp, params)
        if index != self.weight_index:
            raise RuntimeError("the stage's VJP residuals changed structure between traces")
        return stashed

    def rebuild(self, params: Any, stashed: list[jax.Array]):
        """The VJP function from the stage's weights and one stash slot's residuals."""
        return rebuild_vjp(self.treedef, self.weight_index, params, stashed)


def stash_layout(stage_fn: StageFn, params: Any, x: Any, context: Any = (), *, extras: bool = False,
                 chunk_info: dict[str, Any] | None = None) -> _VjpLayout:
    """How a stage's VJP, stage_fn(params, x, context), splits into weights and stashed residuals (`.stashed`:
    their shapes), abstractly (`extras` as in `run_pipeline`; `chunk_info`: the abstract chunk rows of
    `run_pipeline`'s tables, {"rows": ..., "kinds": ...}, which stage_fn takes as keywords)."""
    keys = tuple(chunk_info or ())
    if keys:
        context = (chunk_info, context)
    return _VjpLayout.of(executor_stage(stage_fn, extras=extras, chunk_keys=keys), params, x, context)

"""The pipeline executor's tick loop for split-backward schedules (zb_h1, zb_v): ops F, B and W.

B(mb, c) runs only the input-gradient half of the chunk's backward and saves what the weight-gradient half
needs; W(mb, c), at a later tick, turns those saved values into the chunk's weight gradients. Each op's output
goes around both rings and the plan picks the real copy per receiving stage.

Derivation: docs/explanation/pipeline-executor.md#the-split-backward-tick-loop
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from spmd_train.parallel.pipeline_plan import PipelinePlan
from spmd_train.parallel.split_backward import split_vjp

AXIS = "pipeline"


def head_on_last_chunk(head_fn: Callable, head: Any, y: jax.Array, target: Any, microbatches: int,
                       is_last: jax.Array, loss_scale: jax.Array | None = None) -> tuple[jax.Array, Any, jax.Array]:
    """(loss, head gradients, d loss / d y) of one microbatch, each over `microbatches`, when `is_last` (the chunk
    that ends the model), else zeros: the loss's cotangent starts that microbatch's backward (`loss_scale`: the
    gradients of the loss times it, the loss itself unscaled)."""
    m = microbatches

    def scaled(head, y, target):
        loss = head_fn(head, y, target)
        return (loss if loss_scale is None else loss * loss_scale.astype(loss.dtype)), loss

    def with_head(y):
        (_, loss_mb), (g_head, dy) = jax.value_and_grad(scaled, argnums=(0, 1), has_aux=True)(head, y, target)
        return (loss_mb / m).astype(jnp.float32), jax.tree.map(lambda g: g / m, g_head), dy / m

    def without_head(y):
        return jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, head), jnp.zeros_like(y)

    return jax.lax.cond(is_last, with_head, without_head, y)


def run_split_ticks(plan: PipelinePlan, run_stage: Callable, head_fn: Callable, chunks: Any, head: Any,
                    inputs: jax.Array, targets: Any, chunk_context: Callable, vjp_layout: Any,
                    stats: Any, loss_scale: jax.Array | None = None) -> tuple[Any, Any, Any, Any, Any]:
    """One stage's (grads [v, ...], head grads, loss, d inputs, statistics summed per chunk) from running the plan's
    F, B and W ops; `run_stage` as the fused executor runs it: (params, x, context) -> ((y, loss term), statistics),
    `chunk_context(microbatch, chunk)` what it takes as context, `stats` the zero statistics accumulators, `loss_scale`
    as `run_pipeline` takes it."""
    p, m, last = plan.schedule.stages, plan.schedule.microbatches, plan.schedule.stages * plan.schedule.virtual - 1
    col = {name: i for i, name in enumerate(plan.fields)}
    stage = jax.lax.axis_index(AXIS)
    chunk_params = lambda k: jax.tree.map(lambda a: a[k], chunks)
    of_microbatch = lambda tree, mb: jax.tree.map(lambda a: a[mb], tree)
    x_like = jnp.zeros(inputs.shape[1:], inputs.dtype)
    # Traced once, abstractly, on what the forward runs: B and W are slices of that one fused backward.
    split = split_vjp(run_stage, chunk_params(0), x_like, chunk_context(0, 0), has_aux=True)
    # The stage's loss term enters the mean over microbatches (times the loss scale, as the heads' losses do).
    term_ct = jnp.asarray(1 / m, jnp.float32) if loss_scale is None else loss_scale.astype(jnp.float32) / m

    bufs = jnp.zeros((plan.act_slots + 1, *x_like.shape), x_like.dtype)  # + 1: the spare slot
    stash = [jnp.zeros((plan.stash_slots, *a.shape), a.dtype) for a in vjp_layout.stashed]
    saved = [jnp.zeros((plan.saved_slots, *a.shape), a.dtype) for a in split.saved]
    grads = jax.tree.map(jnp.zeros_like, chunks)
    head_grads = jax.tree.map(jnp.zeros_like, head)
    carry = (bufs, stash, saved, grads, head_grads, jnp.zeros((), jnp.float32), jnp.zeros_like(inputs), stats)

    def rebuilt_vjp(stash, row):
        k, slot = row[col["chunk"]], row[col["stash"]]
        return vjp_layout.rebuild(chunk_params(k), [buf[slot] for buf in stash])

    def forward(carry, row):
        bufs, stash, saved, grads, head_grads, loss, d_inputs, stats = carry
        mb, k, read = row[col["microbatch"]], row[col["chunk"]], row[col["read"]]
        x = jnp.where(read < 0, inputs[mb], bufs[read])
        params, ctx = chunk_params(k), chunk_context(mb, k)
        (y, _), vjp, stats_mb = jax.vjp(lambda params, x: run_stage(params, x, ctx), params, x, has_aux=True)
        stats = jax.tree.map(lambda acc, s: acc.at[k].add(s), stats, stats_mb)
        slot = row[col["stash"]]
        stash = [buf.at[slot].set(r) for buf, r in zip(stash, vjp_layout.residuals(vjp, params), strict=True)]
        is_last = row[col["model_chunk"]] == last
        loss_mb, g_head, dy = head_on_last_chunk(head_fn, head, y, of_microbatch(targets, mb), m, is_last,
                                                 loss_scale)
        head_grads = jax.tree.map(jnp.add, head_grads, g_head)
        out = jnp.where(is_last, dy.astype(y.dtype), y)  # the last chunk's output is its own B's cotangent
        return (bufs, stash, saved, grads, head_grads, loss + loss_mb, d_inputs, stats), out

    def input_grad(carry, row):
        bufs, stash, saved, grads, head_grads, loss, d_inputs, stats = carry
        mb = row[col["microbatch"]]
        dx, values = split.input_grad(rebuilt_vjp(stash, row), (bufs[row[col["read"]]], term_ct))
        slot = row[col["saved"]]
        saved = [buf.at[slot].set(v.astype(buf.dtype)) for buf, v in zip(saved, values, strict=True)]
        first = row[col["model_chunk"]] == 0
        d_inputs = d_inputs.at[mb].set(jnp.where(first, dx, d_inputs[mb]))
        return (bufs, stash, saved, grads, head_grads, loss, d_inputs, stats), dx.astype(x_like.dtype)

    def weight_grad(carry, row):
        bufs, stash, saved, grads, head_grads, loss, d_inputs, stats = carry
        k, slot = row[col["chunk"]], row[col["saved"]]
        g_chunk = split.weight_grad(rebuilt_vjp(stash, row), [buf[slot] for buf in saved])
        grads = jax.tree.map(lambda acc, g: acc.at[k].add(g.astype(acc.dtype)), grads, g_chunk)
        return (bufs, stash, saved, grads, head_grads, loss, d_inputs, stats), x_like

    def idle(carry, row):
        return carry, x_like

    def tick(carry, rows_t):
        row = rows_t[stage]
        carry, out = jax.lax.switch(row[col["kind"]], [idle, forward, input_grad, weight_grad], carry, row)
        got_down = jax.lax.ppermute(out, AXIS, [(i, (i + 1) % p) for i in range(p)])
        # With 2 stages both rings are one permutation: one collective carries the value both ways.
        got_up = got_down if p == 2 else jax.lax.ppermute(out, AXIS, [(i, (i - 1) % p) for i in range(p)])
        bufs, *rest = carry
        bufs = bufs.at[row[col["keep"]]].set(out)
        bufs = bufs.at[row[col["recv_down"]]].set(got_down)
        bufs = bufs.at[row[col["recv_up"]]].set(got_up)
        return (bufs, *rest), None

    carry, _ = jax.lax.scan(tick, carry, jnp.asarray(plan.rows))
    _, _, _, grads, head_grads, loss, d_inputs, stats = carry
    return grads, head_grads, loss, d_inputs, stats

"""Pallas flash-attention kernels: forward (online softmax) and backward (dq, dk/dv).

Layout inside the kernels: [batch, heads, length, head_dim], lengths padded to whole blocks.
Each program owns one block of rows and loops over the blocks of the other side, reading
them from a ref that spans the whole (padded) length; causal programs stop at the diagonal
instead of computing blocks that are entirely masked. Softmax statistics and accumulators are
fp32 whatever the input dtype. Masked scores use a large finite negative value, and masked
probabilities are zeroed explicitly, so a row with nothing to attend to yields zeros (and a
very negative log-sum-exp), never NaN.

Kernels know nothing of meshes: callers wrap them in `shard_map` (see `spmd_train.parallel`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

MASK = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclass(frozen=True)
class Plan:
    """Static facts about one attention call."""

    scale: float
    causal: bool
    block_q: int
    block_k: int
    q_len: int
    kv_len: int
    groups: int
    interpret: bool
    poison: bool = False
    """Start every output as NaN (aliased input), so a block the kernel fails to write shows up."""


_POISON = contextvars.ContextVar("flash_attention_poison", default=False)


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Within this block, kernel outputs start as NaN instead of uninitialised memory (for tests)."""
    token = _POISON.set(True)
    try:
        yield
    finally:
        _POISON.reset(token)


def poison_requested() -> bool:
    """Whether `poisoned_outputs` is active."""
    return _POISON.get()


def _call(body, *, plan: Plan, grid, in_specs, out_specs, out_shape, name, args):
    """pallas_call, with NaN-filled outputs aliased in when the plan asks for poisoning."""
    if not plan.poison:
        return pl.pallas_call(body, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                              interpret=plan.interpret, name=name)(*args)
    n_in, n_out = len(args), len(out_shape)
    poison = [jnp.full(s.shape, jnp.nan, s.dtype) for s in out_shape]

    def without_poison(*refs):
        return body(*refs[:n_in], *refs[n_in + n_out:])

    return pl.pallas_call(without_poison, grid=grid, in_specs=[*in_specs, *out_specs], out_specs=out_specs,
                          out_shape=out_shape, input_output_aliases={n_in + i: i for i in range(n_out)},
                          interpret=plan.interpret, name=name)(*args, *poison)


def _scores(q, k, q_start, k_start, q_seg, k_seg, plan: Plan):
    """Scaled scores of a [block_q, d] x [block_k, d] tile and the mask of entries that count."""
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * plan.scale
    rows = q_start + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
    cols = k_start + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    mask = (cols < plan.kv_len) & (q_seg == k_seg)
    if plan.causal:
        mask &= rows >= cols
    return jnp.where(mask, s, MASK), mask


def _kv_tile(k_ref, v_ref, kseg_ref, k_start, plan: Plan):
    """The K, V and segment-id tile starting at k_start (the whole refs when there is one tile).

    With a single tile there is nothing to slice, which spares TPU from proving a dynamic
    offset into the lane dimension is 128-aligned.
    """
    if k_ref.shape[0] == plan.block_k:
        return k_ref[...], v_ref[...], kseg_ref[...]
    cols = pl.ds(k_start, plan.block_k)
    return k_ref[cols, :], v_ref[cols, :], kseg_ref[:, cols]


def _kv_blocks(q_start, plan: Plan, padded_kv: int):
    """How many K/V blocks a row block must visit (causal: up to the diagonal)."""
    total = padded_kv // plan.block_k
    if not plan.causal:
        return total
    return jnp.minimum(total, pl.cdiv(q_start + plan.block_q, plan.block_k))


def _forward_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, o_ref, lse_ref, *, plan: Plan):
    q_start = pl.multiple_of(pl.program_id(2) * plan.block_q, plan.block_q)
    q = q_ref[...]
    q_seg = qseg_ref[...]
    d = q.shape[-1]

    def body(j, carry):
        m, l, acc = carry
        k_start = pl.multiple_of(j * plan.block_k, plan.block_k)
        k, v, k_seg = _kv_tile(k_ref, v_ref, kseg_ref, k_start, plan)
        s, mask = _scores(q, k, q_start, k_start, q_seg, k_seg, plan)
        m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + p.sum(axis=1, keepdims=True)
        acc = alpha * acc + jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                                preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full((plan.block_q, 1), MASK, jnp.float32), jnp.zeros((plan.block_q, 1), jnp.float32),
            jnp.zeros((plan.block_q, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, _kv_blocks(q_start, plan, k_ref.shape[0]), body, init)
    safe = jnp.where(l == 0.0, 1.0, l)
    o_ref[...] = (acc / safe).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(safe)


def _dq_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref, dq_ref, *, plan: Plan):
    q_start = pl.multiple_of(pl.program_id(2) * plan.block_q, plan.block_q)
    q, do = q_ref[...], do_ref[...]
    lse, delta, q_seg = lse_ref[...], delta_ref[...], qseg_ref[...]

    def body(j, dq):
        k_start = pl.multiple_of(j * plan.block_k, plan.block_k)
        k, v, k_seg = _kv_tile(k_ref, v_ref, kseg_ref, k_start, plan)
        s, mask = _scores(q, k, q_start, k_start, q_seg, k_seg, plan)
        p = jnp.where(mask, jnp.exp(s - lse), 0.0)
        dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - delta)
        return dq + jax.lax.dot_general(ds.astype(k.dtype), k, (((1,), (0,)), ((), ())),
                                        preferred_element_type=jnp.float32)

    dq = jax.lax.fori_loop(0, _kv_blocks(q_start, plan, k_ref.shape[0]), body,
                           jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * plan.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                plan: Plan):
    # One K/V block of one K/V head, against every query head of its group.
    k_start = pl.multiple_of(pl.program_id(2) * plan.block_k, plan.block_k)
    k, v = k_ref[...], v_ref[...]
    k_seg = kseg_ref[...]
    q_blocks = q_ref.shape[1] // plan.block_q
    first = k_start // plan.block_q if plan.causal else 0

    def over_queries(g, carry):
        def body(i, carry):
            dk, dv = carry
            q_start = pl.multiple_of(i * plan.block_q, plan.block_q)
            rows = pl.ds(q_start, plan.block_q)
            q, do = q_ref[g, rows, :], do_ref[g, rows, :]
            s, mask = _scores(q, k, q_start, k_start, qseg_ref[rows, :], k_seg, plan)
            p = jnp.where(mask, jnp.exp(s - lse_ref[g, rows, :]), 0.0)
            dv = dv + jax.lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32)
            dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            ds = p * (dp - delta_ref[g, rows, :])
            dk = dk + jax.lax.dot_general(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32)
            return dk, dv

        return jax.lax.fori_loop(first, q_blocks, body, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, plan.groups, over_queries, (zeros, zeros))
    dk_ref[...] = (dk * plan.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def forward(q, k, v, q_seg, kv_seg, plan: Plan):
    """q [b, h, Lq, d], k/v [b, kvh, Lk, d], q_seg [b, Lq, 1], kv_seg [b, 1, Lk] -> (o, lse [b, h, Lq, 1])."""
    b, h, lq, d = q.shape
    lk = k.shape[2]
    sq = pl.squeezed
    grid = (b, h, lq // plan.block_q)
    row = pl.BlockSpec((sq, sq, plan.block_q, d), lambda b_, h_, i: (b_, h_, i, 0))
    kv = pl.BlockSpec((sq, sq, lk, d), lambda b_, h_, i: (b_, h_ // plan.groups, 0, 0))
    return _call(
        functools.partial(_forward_kernel, plan=plan),
        plan=plan,
        grid=grid,
        in_specs=[row, kv, kv,
                  pl.BlockSpec((sq, plan.block_q, 1), lambda b_, h_, i: (b_, i, 0)),
                  pl.BlockSpec((sq, 1, lk), lambda b_, h_, i: (b_, 0, 0))],
        out_specs=[row, pl.BlockSpec((sq, sq, plan.block_q, 1), lambda b_, h_, i: (b_, h_, i, 0))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, lq, 1), jnp.float32)],
        name="flash_attention_fwd",
        args=(q, k, v, q_seg, kv_seg),
    )


def backward(q, k, v, q_seg, kv_seg, o, lse, do, plan: Plan):
    """Gradients (dq, dk, dv) given the output, its log-sum-exp and the output cotangent."""
    b, h, lq, d = q.shape
    kvh, lk = k.shape[1], k.shape[2]
    sq = pl.squeezed
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1, keepdims=True)
    row = pl.BlockSpec((sq, sq, plan.block_q, d), lambda b_, h_, i: (b_, h_, i, 0))
    row_stat = pl.BlockSpec((sq, sq, plan.block_q, 1), lambda b_, h_, i: (b_, h_, i, 0))
    kv_full = pl.BlockSpec((sq, sq, lk, d), lambda b_, h_, i: (b_, h_ // plan.groups, 0, 0))
    (dq,) = _call(
        functools.partial(_dq_kernel, plan=plan),
        plan=plan,
        grid=(b, h, lq // plan.block_q),
        in_specs=[row, kv_full, kv_full,
                  pl.BlockSpec((sq, plan.block_q, 1), lambda b_, h_, i: (b_, i, 0)),
                  pl.BlockSpec((sq, 1, lk), lambda b_, h_, i: (b_, 0, 0)),
                  row, row_stat, row_stat],
        out_specs=[row],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)],
        name="flash_attention_dq",
        args=(q, k, v, q_seg, kv_seg, do, lse, delta),
    )

    g = plan.groups
    group_rows = pl.BlockSpec((sq, g, lq, d), lambda b_, j_, i: (b_, j_, 0, 0))
    group_stat = pl.BlockSpec((sq, g, lq, 1), lambda b_, j_, i: (b_, j_, 0, 0))
    kv_block = pl.BlockSpec((sq, sq, plan.block_k, d), lambda b_, j_, i: (b_, j_, i, 0))
    dk, dv = _call(
        functools.partial(_dkv_kernel, plan=plan),
        plan=plan,
        grid=(b, kvh, lk // plan.block_k),
        in_specs=[group_rows, kv_block, kv_block,
                  pl.BlockSpec((sq, lq, 1), lambda b_, j_, i: (b_, 0, 0)),
                  pl.BlockSpec((sq, 1, plan.block_k), lambda b_, j_, i: (b_, 0, i)),
                  group_rows, group_stat, group_stat],
        out_specs=[kv_block, kv_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        name="flash_attention_dkv",
        args=(q, k, v, q_seg, kv_seg, do, lse, delta),
    )
    return dq, dk, dv

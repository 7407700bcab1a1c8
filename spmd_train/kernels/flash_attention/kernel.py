"""Pallas flash-attention kernels: forward (online softmax) and backward (dq, dk/dv).

Both sides are tiled over the grid with fp32 accumulators in scratch memory, so on-chip memory depends on the
block sizes only, never on the sequence length; causal programs skip fully masked blocks. Kernels know nothing of
meshes: callers wrap them in `shard_map` (see `spmd_train.parallel`).

Design: docs/attention.md#the-pallas-kernels
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
from jax.experimental.pallas import tpu as pltpu

MASK = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclass(frozen=True)
class KernelPlan:
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
    gpu: bool = False
    """Run the Mosaic GPU kernels (`gpu_kernel.py`) rather than these."""
    segments: bool = True
    """Whether segment ids can mask anything (given by the caller, or padded keys without causality)."""
    window: int | None = None
    """A query sees only keys with q_pos - k_pos < window; the grid walks only the blocks the band touches."""
    softcap: float | None = None
    """Scores become softcap * tanh(scores / softcap) before masking."""
    q_offset: int = 0
    """Query row r sits at position r + q_offset, key column c at c (a later block of a longer sequence)."""


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


def _call(body, *, plan: KernelPlan, grid, in_specs, out_specs, out_shape, scratch, parallel: int, name, args):
    """pallas_call over a grid whose first `parallel` dimensions are independent and whose others
    accumulate into `scratch`; with NaN-filled outputs aliased in when the plan asks for poisoning."""
    semantics = ("parallel",) * parallel + ("arbitrary",) * (len(grid) - parallel)
    common = {"grid": grid, "out_shape": out_shape, "scratch_shapes": scratch, "interpret": plan.interpret,
              "name": name,
              "compiler_params": None if plan.interpret else pltpu.CompilerParams(dimension_semantics=semantics)}
    if not plan.poison:
        return pl.pallas_call(body, in_specs=in_specs, out_specs=out_specs, **common)(*args)
    n_in, n_out = len(args), len(out_shape)
    poison = [jnp.full(s.shape, jnp.nan, s.dtype) for s in out_shape]

    def without_poison(*refs):
        return body(*refs[:n_in], *refs[n_in + n_out:])

    return pl.pallas_call(without_poison, in_specs=[*in_specs, *out_specs], out_specs=out_specs,
                          input_output_aliases={n_in + i: i for i in range(n_out)}, **common)(*args, *poison)


def _scores(q, k, q_start, k_start, q_seg, k_seg, plan: KernelPlan):
    """Scaled (and capped) scores of a [block_q, d] x [block_k, d] tile, the mask of entries that count, and the
    cap's derivative d capped / d scaled (None without a cap; 0 where masked, so the backward never meets the
    mask's huge value)."""
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * plan.scale
    rows = q_start + plan.q_offset + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
    cols = k_start + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    mask = (cols < plan.kv_len) & (q_seg == k_seg)
    if plan.causal:
        mask &= rows >= cols
    if plan.window is not None:
        mask &= rows - cols < plan.window
    slope = None
    if plan.softcap is not None:
        t = jnp.tanh(s / plan.softcap)
        s, slope = plan.softcap * t, jnp.where(mask, 1.0 - t * t, 0.0)
    return jnp.where(mask, s, MASK), mask, slope


def _visible(q_start, k_start, plan: KernelPlan):
    """Whether a (row block, column block) pair can hold an unmasked entry under causality and the window."""
    return tile_visible(q_start, plan.block_q, k_start, plan.block_k, plan)


def tile_visible(q_start, q_rows: int, k_start, k_rows: int, plan: KernelPlan):
    """Whether rows [q_start, q_start + q_rows) and keys [k_start, k_start + k_rows) hold an entry that causality and
    the window leave unmasked (Python True when neither masks anything). Python or traced ints: the GPU kernels ask
    it per 64-row warpgroup tile, these per block."""
    seen = True
    if plan.causal:
        seen = k_start <= q_start + plan.q_offset + q_rows - 1
    if plan.window is not None:
        near = k_start + k_rows - 1 > q_start + plan.q_offset - plan.window
        seen = near if seen is True else seen & near
    return seen


def last_kv_block(i, block_q: int, block_k: int, q_offset: int = 0):
    """Index of the last K/V block that row block i sees under causality (Python or traced ints).

    The one rule every consumer shares: the TPU index maps clamp to it, the GPU pipelines stream
    up to it, and `analysis.hlo` counts the visible block pairs the kernels compute with it."""
    return (i * block_q + q_offset + block_q - 1) // block_k


def first_kv_block(i, block_q: int, block_k: int, window: int, q_offset: int = 0):
    """Index of the first K/V block row block i sees under a window (negative where the window reaches before the
    first key: callers clamp). Python or traced ints, like `last_kv_block`."""
    return (i * block_q + q_offset - window + 1) // block_k


def first_q_block(kb, block_q: int, block_k: int, q_offset: int = 0):
    """Index of the first row block that sees K/V block kb under causality (negative: callers clamp)."""
    return (kb * block_k - q_offset) // block_q


def last_q_block(kb, block_q: int, block_k: int, window: int, q_offset: int = 0):
    """Index of the last row block K/V block kb's keys reach under a window (past the last row block: clamp)."""
    return (kb * block_k + block_k - 1 + window - 1 - q_offset) // block_q


def kv_block_range(i, plan: KernelPlan, n_kv: int):
    """(first, last) K/V blocks row block i can see (inclusive; first > last when it sees none): causality ends the
    range, the window starts it. Python or traced ints; `max`/`min` are jnp's when i is traced."""
    lo, hi = (max, min) if isinstance(i, int) else (jnp.maximum, jnp.minimum)
    last = hi(last_kv_block(i, plan.block_q, plan.block_k, plan.q_offset), n_kv - 1) if plan.causal else n_kv - 1
    first = 0
    if plan.window is not None:
        first = lo(first_kv_block(i, plan.block_q, plan.block_k, plan.window, plan.q_offset), 0)
    return first, last


def q_block_range(kb, plan: KernelPlan, n_q: int, block_q: int | None = None):
    """(first, last) row blocks that can see K/V block kb (inclusive), as `kv_block_range` from the other side.
    `block_q`: rows per row block when not the plan's (the GPU dk/dv kernel streams 64-row query tiles)."""
    lo, hi = (max, min) if isinstance(kb, int) else (jnp.maximum, jnp.minimum)
    bq, bk = block_q or plan.block_q, plan.block_k
    first = lo(first_q_block(kb, bq, bk, plan.q_offset), 0) if plan.causal else 0
    last = n_q - 1
    if plan.window is not None:
        last = hi(last_q_block(kb, bq, bk, plan.window, plan.q_offset), n_q - 1)
    return first, last


def band_steps(plan: KernelPlan, n_q: int, n_kv: int) -> tuple[int, int]:
    """Grid steps over K/V blocks per row block, and over row blocks per K/V block: all of them, or under a causal
    window only as many as its band can touch (so the grid, not only the compute, scales with the window)."""
    if plan.window is None or not plan.causal:
        return n_kv, n_q
    span = plan.block_q + plan.window - 1  # keys one row block's queries see, and rows one key block's keys reach
    return (min(n_kv, -(-span // plan.block_k) + 1), min(n_q, -(-(plan.block_k + plan.window - 1) // plan.block_q) + 1))


def visible_pairs(plan: KernelPlan, n_q: int, n_kv: int) -> int:
    """(row block, K/V block) pairs the kernels compute: what `analysis.hlo` counts their FLOPs by."""
    total = 0
    for i in range(n_q):
        first, last = kv_block_range(i, plan, n_kv)
        total += sum(1 for j in range(first, last + 1) if _visible(i * plan.block_q, j * plan.block_k, plan))
    return total


def _forward_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *, plan: KernelPlan,
                    n_kv: int):
    i, j = pl.program_id(2), pl.program_id(3)
    first, last = kv_block_range(i, plan, n_kv)
    q_start, k_start = i * plan.block_q, (first + j) * plan.block_k

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when((first + j <= last) & _visible(q_start, k_start, plan))
    def _step():
        v = v_ref[...]
        s, mask, _ = _scores(q_ref[...], k_ref[...], q_start, k_start, qseg_ref[...], kseg_ref[...], plan)
        m = m_sc[...]
        m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m - m_new)
        l_sc[...] = alpha * l_sc[...] + p.sum(axis=1, keepdims=True)
        acc_sc[...] = alpha * acc_sc[...] + jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                                                preferred_element_type=jnp.float32)
        m_sc[...] = m_new

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        l = l_sc[...]
        safe = jnp.where(l == 0.0, 1.0, l)
        o_ref[...] = (acc_sc[...] / safe).astype(o_ref.dtype)
        lse_ref[...] = m_sc[...] + jnp.log(safe)


def _dq_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref, dq_ref, dq_sc, *, plan: KernelPlan,
               n_kv: int):
    i, j = pl.program_id(2), pl.program_id(3)
    first, last = kv_block_range(i, plan, n_kv)
    q_start, k_start = i * plan.block_q, (first + j) * plan.block_k

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @pl.when((first + j <= last) & _visible(q_start, k_start, plan))
    def _step():
        k, v, do = k_ref[...], v_ref[...], do_ref[...]
        s, mask, slope = _scores(q_ref[...], k, q_start, k_start, qseg_ref[...], kseg_ref[...], plan)
        p = jnp.where(mask, jnp.exp(s - lse_ref[...]), 0.0)
        dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - delta_ref[...])
        if slope is not None:
            ds = ds * slope
        dq_sc[...] += jax.lax.dot_general(ds.astype(k.dtype), k, (((1,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = (dq_sc[...] * plan.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_sc, dv_sc,
                *, plan: KernelPlan, n_q: int):
    # One K/V block of one K/V head; the grid walks every query head of its group, then the row blocks that see it.
    kb, g, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)
    first, last = q_block_range(kb, plan, n_q)
    q_start, k_start = (first + i) * plan.block_q, kb * plan.block_k
    is_first = (g == 0) & (i == 0)
    is_last = (g == pl.num_programs(3) - 1) & (i == pl.num_programs(4) - 1)

    @pl.when(is_first)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when((first + i <= last) & _visible(q_start, k_start, plan))
    def _step():
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        s, mask, slope = _scores(q, k, q_start, k_start, qseg_ref[...], kseg_ref[...], plan)
        p = jnp.where(mask, jnp.exp(s - lse_ref[...]), 0.0)
        dv_sc[...] += jax.lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32)
        dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - delta_ref[...])
        if slope is not None:
            ds = ds * slope
        dk_sc[...] += jax.lax.dot_general(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32)

    @pl.when(is_last)
    def _finish():
        dk_ref[...] = (dk_sc[...] * plan.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def forward(q, k, v, q_seg, kv_seg, plan: KernelPlan):
    """q [b, h, Lq, d], k/v [b, kvh, Lk, d], q_seg [b, Lq, 1], kv_seg [b, 1, Lk] -> (o, lse [b, h, Lq, 1])."""
    b, h, lq, d = q.shape
    lk = k.shape[2]
    sq, bq, bk = pl.squeezed, plan.block_q, plan.block_k
    n_q, n_kv = lq // bq, lk // bk
    kv_at = _kv_index(plan, n_kv)
    row = pl.BlockSpec((sq, sq, bq, d), lambda b_, h_, i, j: (b_, h_, i, 0))
    kv = pl.BlockSpec((sq, sq, bk, d), lambda b_, h_, i, j: (b_, h_ // plan.groups, kv_at(i, j), 0))
    f32 = jnp.float32
    return _call(
        functools.partial(_forward_kernel, plan=plan, n_kv=n_kv),
        plan=plan,
        grid=(b, h, n_q, band_steps(plan, n_q, n_kv)[0]),
        in_specs=[row, kv, kv,
                  pl.BlockSpec((sq, bq, 1), lambda b_, h_, i, j: (b_, i, 0)),
                  pl.BlockSpec((sq, 1, bk), lambda b_, h_, i, j: (b_, 0, kv_at(i, j)))],
        out_specs=[row, pl.BlockSpec((sq, sq, bq, 1), lambda b_, h_, i, j: (b_, h_, i, 0))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, lq, 1), f32)],
        scratch=[pltpu.VMEM((bq, 1), f32), pltpu.VMEM((bq, 1), f32), pltpu.VMEM((bq, d), f32)],
        parallel=3,
        name=kernel_name("fwd", plan),
        args=(q, k, v, q_seg, kv_seg),
    )


def backward(q, k, v, q_seg, kv_seg, lse, do, delta, plan: KernelPlan):
    """Gradients (dq, dk, dv) from the log-sum-exp, the output cotangent and delta [b, h, Lq, 1]
    (rowsum(dO * O) less the log-sum-exp's cotangent; see `api._attention_bwd`)."""
    b, h, lq, d = q.shape
    kvh, lk = k.shape[1], k.shape[2]
    sq, bq, bk, g = pl.squeezed, plan.block_q, plan.block_k, plan.groups
    n_q, n_kv = lq // bq, lk // bk
    kv_steps, q_steps = band_steps(plan, n_q, n_kv)
    f32 = jnp.float32
    kv_at = _kv_index(plan, n_kv)
    row = pl.BlockSpec((sq, sq, bq, d), lambda b_, h_, i, j: (b_, h_, i, 0))
    row_stat = pl.BlockSpec((sq, sq, bq, 1), lambda b_, h_, i, j: (b_, h_, i, 0))
    kv = pl.BlockSpec((sq, sq, bk, d), lambda b_, h_, i, j: (b_, h_ // g, kv_at(i, j), 0))
    (dq,) = _call(
        functools.partial(_dq_kernel, plan=plan, n_kv=n_kv),
        plan=plan,
        grid=(b, h, n_q, kv_steps),
        in_specs=[row, kv, kv,
                  pl.BlockSpec((sq, bq, 1), lambda b_, h_, i, j: (b_, i, 0)),
                  pl.BlockSpec((sq, 1, bk), lambda b_, h_, i, j: (b_, 0, kv_at(i, j))),
                  row, row_stat, row_stat],
        out_specs=[row],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)],
        scratch=[pltpu.VMEM((bq, d), f32)],
        parallel=3,
        name=kernel_name("dq", plan),
        args=(q, k, v, q_seg, kv_seg, do, lse, delta),
    )

    q_at = _q_index(plan, n_q)
    q_row = pl.BlockSpec((sq, sq, bq, d), lambda b_, j_, kb, g_, i: (b_, j_ * g + g_, q_at(kb, i), 0))
    q_stat = pl.BlockSpec((sq, sq, bq, 1), lambda b_, j_, kb, g_, i: (b_, j_ * g + g_, q_at(kb, i), 0))
    kv_block = pl.BlockSpec((sq, sq, bk, d), lambda b_, j_, kb, g_, i: (b_, j_, kb, 0))
    dk, dv = _call(
        functools.partial(_dkv_kernel, plan=plan, n_q=n_q),
        plan=plan,
        grid=(b, kvh, n_kv, g, q_steps),
        in_specs=[q_row, kv_block, kv_block,
                  pl.BlockSpec((sq, bq, 1), lambda b_, j_, kb, g_, i: (b_, q_at(kb, i), 0)),
                  pl.BlockSpec((sq, 1, bk), lambda b_, j_, kb, g_, i: (b_, 0, kb)),
                  q_row, q_stat, q_stat],
        out_specs=[kv_block, kv_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch=[pltpu.VMEM((bk, d), f32), pltpu.VMEM((bk, d), f32)],
        parallel=3,
        name=kernel_name("dkv", plan),
        args=(q, k, v, q_seg, kv_seg, do, lse, delta),
    )
    return dq, dk, dv


KERNEL_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}
"""Block matmuls each kernel runs per visible (row block, column block) pair: QK^T and PV;
QK^T, dO V^T and dS K; QK^T, P^T dO, dO V^T and dS^T Q. `analysis.hlo` counts FLOPs from this."""


def kernel_name(kind: str, plan: KernelPlan) -> str:
    """The custom call's name: kernel, causality, window, query offset and block sizes, so compiled-program analysis
    can count the matmuls inside it (e.g. flash_attention_fwd_causal_q512_k512, flash_attention_dq_causal_w1024_q512
    _k512)."""
    causal = "_causal" if plan.causal else ""
    window = f"_w{plan.window}" if plan.window is not None else ""
    offset = f"_o{plan.q_offset}" if plan.q_offset else ""
    return f"flash_attention_{kind}{causal}{window}{offset}_q{plan.block_q}_k{plan.block_k}"


def _kv_index(plan: KernelPlan, n_kv: int):
    """K/V block to copy in for (row block i, step j): steps past the last visible block repeat it (no new copy)."""
    if not plan.causal and plan.window is None:
        return lambda i, j: j

    def at(i, j):
        first, last = kv_block_range(i, plan, n_kv)
        return jnp.maximum(jnp.minimum(first + j, last), 0)
    return at


def _q_index(plan: KernelPlan, n_q: int):
    """Row block to copy in for (K/V block kb, step i): steps past the last row block that sees it repeat it."""
    if not plan.causal and plan.window is None:
        return lambda kb, i: i

    def at(kb, i):
        first, last = q_block_range(kb, plan, n_q)
        return jnp.maximum(jnp.minimum(first + i, last), 0)
    return at

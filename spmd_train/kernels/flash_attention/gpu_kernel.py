"""Flash attention for Hopper GPUs as Mosaic GPU Pallas kernels: forward, dq and dk/dv.

Mosaic GPU rather than Pallas' Triton lowering, for TMA copies, warpgroup matmuls and warp specialisation: each
program is a producer warpgroup streaming the other side's tiles plus `wgs` compute warpgroups of 64 rows each.
Same layout and masking rules as the TPU kernels (`kernel.py`); softmax runs in base 2, the saved log-sum-exp is
natural-log.

Design: docs/attention.md#the-gpu-kernels-hopper
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from spmd_train.kernels.flash_attention.gpu_ops import ROWS_PER_WARPGROUP, HopperOps, cols, rows
from spmd_train.kernels.flash_attention.kernel import (
    MASK,
    KernelPlan,
    kernel_name,
    kv_block_range,
    q_block_range,
    tile_visible,
)

LOG2E = math.log2(math.e)
PIPELINE_STAGES = 2
"""Shared-memory ring depth of the streamed side (K/V in forward and dq, Q/dO in dk/dv)."""
PRODUCER_REGISTERS = 40
"""Registers per thread left to the producer warpgroup; the compute warpgroups get the rest."""


def _swizzled(dtype):
    # 128-byte rows swizzled over (8, 128 bytes) tiles: what TMA writes and wgmma reads without bank conflicts.
    return plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(128)


def _smem_tile(shape, dtype):
    return plgpu.SMEM(shape, dtype, transforms=_swizzled(dtype))


def _tile_spec(block, dtype, index_map):
    return plgpu.BlockSpec(block_shape=block, index_map=index_map, transforms=_swizzled(dtype))


def _kernel(body, *, plan: KernelPlan, out_type, grid, names, wgs: int, name: str, args):
    # Mosaic GPU names the kernel after its body function: keep the kernel name readable in profiles.
    body.__name__ = body.__qualname__ = name
    return plgpu.kernel(
        body, out_type=out_type, grid=grid, grid_names=names, num_threads=wgs + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **({"interpret": _interpret_params()} if plan.interpret else {}),
    )(*args)


def _interpret_params():
    """Mosaic GPU's interpreter settings (buffers start as NaN). jax 0.10 exports them only privately."""
    public = getattr(plgpu, "InterpretParams", None)
    if public is not None:
        return public()
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def _scores(ops: HopperOps, s, q_start, k_start, q_seg, k_seg, plan: KernelPlan, *, transposed: bool):
    """Base-2 scores of a tile (scaled, then soft-capped), the mask of entries that count (None when nothing is
    masked) and the soft-cap's derivative d capped / d scaled (None without a cap; the backward multiplies dS by it).

    `transposed`: the tile is [keys, queries] (the dk/dv kernel) rather than [queries, keys]."""
    slope = None
    if plan.softcap is None:
        s = s * (plan.scale * LOG2E)
    else:  # softcap * tanh(scaled / softcap), in base 2; masked entries get MASK below, so slope needs no mask
        t = jnp.tanh(s * (plan.scale / plan.softcap))
        s, slope = t * (plan.softcap * LOG2E), 1.0 - t * t
    keep = None
    if plan.causal or plan.window is not None:
        q_pos = q_start + plan.q_offset + ops.iota(s.shape, 1 if transposed else 0)
        k_pos = k_start + ops.iota(s.shape, 0 if transposed else 1)
        if plan.causal:
            keep = q_pos >= k_pos
        if plan.window is not None:
            near = q_pos - k_pos < plan.window
            keep = near if keep is None else keep & near
    if plan.segments:
        same = (rows(k_seg, s.shape) == cols(q_seg, s.shape)) if transposed else (
            rows(q_seg, s.shape) == cols(k_seg, s.shape))
        keep = same if keep is None else keep & same
    if keep is not None:
        s = jnp.where(keep, s, MASK)
    return s, keep, slope


def kv_tiles(block, plan: KernelPlan, n_kv: int):
    """(first, count): the K/V tiles row block `block` streams. All of them, or under causality and a window only
    those its band can touch (`kernel.kv_block_range`, the TPU kernels' rule), so fully masked tiles are never even
    copied in and the trip count scales with the window, not the length (dynamic, unless nothing is masked)."""
    return _span(*kv_block_range(block, plan, n_kv))


def q_tiles(block, plan: KernelPlan, n_q: int, step_q: int):
    """(first, count): the `step_q`-row query tiles K/V block `block` streams in the dk/dv kernel, per query head of
    the group (`kernel.q_block_range`)."""
    return _span(*q_block_range(block, plan, n_q, block_q=step_q))


def _span(first, last):
    """(first, count) of an inclusive range of tiles, at least one long: where a query offset puts every key out of
    reach the one tile is fully masked, as the pipeline needs a step to write its outputs."""
    if isinstance(first, int) and first == 0:  # no lower bound (last >= 0): static when last is
        return first, last + 1
    first = min(first, last) if isinstance(first, int) and isinstance(last, int) else jnp.minimum(first, last)
    return first, last - first + 1


def _load_all(loads, barriers, wg):
    """Start every gmem -> smem copy (one barrier each), then wait for all: one round trip, not several."""
    for (src, dst), barrier in zip(loads, barriers, strict=False):
        plgpu.copy_gmem_to_smem(src, dst, barrier.at[wg])
    for _, barrier in zip(loads, barriers, strict=False):
        plgpu.barrier_wait(barrier.at[wg])


def _masked(p, keep):
    return p if keep is None else jnp.where(keep, p, 0.0)


def _capped(ds, slope):
    """dS with respect to the scaled scores: through the soft-cap's tanh when there is one."""
    return ds if slope is None else ds * slope


def _stream_kv(step, context, tiles, n_kv: int, wgs: int, plan: KernelPlan, dtype, d: int, k, v, k_seg):
    """Run `step` over the K/V tiles a row block needs (`tiles`: `kv_tiles`' first and count), the producer
    warpgroup streaming them (and the key segment ids, when they can mask anything) through the shared-memory ring."""
    bk, (first, count) = plan.block_k, tiles
    kv_spec = _tile_spec((bk, d), dtype, lambda j: (first + j, 0))
    specs, refs = [kv_spec, kv_spec], [k, v]
    if plan.segments:
        specs.append(plgpu.BlockSpec(block_shape=(bk,), index_map=lambda j: (first + j,)))
        refs.append(k_seg)
    pipeline = plgpu.emit_pipeline_warp_specialized(
        step, grid=(count,), memory_registers=PRODUCER_REGISTERS, wg_axis="wg",
        num_compute_wgs=wgs, max_concurrent_steps=min(PIPELINE_STAGES, n_kv), compute_context=context,
        in_specs=specs)
    pipeline(*refs)


def forward(q, k, v, q_seg, kv_seg, plan: KernelPlan):
    """q [b, h, Lq, d], k/v [b, kvh, Lk, d], q_seg [b, Lq], kv_seg [b, Lk] -> (o, lse [b, h, Lq, 1])."""
    b, h, lq, d = q.shape
    lk = k.shape[2]
    bq, bk, dtype = plan.block_q, plan.block_k, q.dtype
    wgs, r = bq // ROWS_PER_WARPGROUP, ROWS_PER_WARPGROUP
    n_kv = lk // bk
    ops = HopperOps(plan.interpret)

    def body(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, o_ref, lse_ref):
        batch, head, block = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("rows")
        kv_head = lax.div(head, jnp.int32(plan.groups))
        tiles = kv_tiles(block, plan, n_kv)

        def with_scratch(q_smem2, lse_smem2, seg_smem2, barriers):
            def context(pipeline):
                wg = lax.axis_index("wg")
                q_smem, lse_smem, seg_smem = q_smem2.at[wg], lse_smem2.at[wg], seg_smem2.at[wg]
                q_start = block * bq + wg * r
                loads = [(q_ref.at[batch, head, pl.ds(q_start, r)], q_smem)]
                if plan.segments:
                    loads.append((qseg_ref.at[batch, pl.ds(q_start, r)], seg_smem))
                _load_all(loads, barriers, wg)
                q_seg_rows = ops.load_rows(seg_smem) if plan.segments else None
                carry = (ops.zeros((r, d)), ops.row_vector(MASK, r), ops.row_vector(0.0, r), q_start, q_seg_rows)
                acc, m, l, _, _ = pipeline(carry)
                safe = jnp.where(l == 0.0, 1.0, l)
                q_smem[...] = (acc / rows(safe, acc.shape)).astype(dtype)
                lse_smem[...] = (m + jnp.log2(safe)) / LOG2E
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(q_smem, o_ref.at[batch, head, pl.ds(q_start, r)], commit_group=False)
                plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, pl.ds(q_start, r)], commit_group=False)
                plgpu.commit_smem_to_gmem_group()
                plgpu.wait_smem_to_gmem(0)

            def step(indices, k_smem, v_smem, *rest):
                *kseg_smem, (acc, m, l, q_start, q_seg_rows) = rest
                k_start = (tiles[0] + indices[0]) * bk
                q_smem = q_smem2.at[lax.axis_index("wg")]

                def compute(acc, m, l):
                    k_seg = ops.load_cols(kseg_smem[0]) if plan.segments else None
                    s, keep, _ = _scores(ops, ops.matmul(q_smem, k_smem, (r, bk), transpose_b=True),
                                         q_start, k_start, q_seg_rows, k_seg, plan, transposed=False)
                    m_new = jnp.maximum(m, s.max(axis=1))
                    p = _masked(jnp.exp2(s - rows(m_new, s.shape)), keep)
                    alpha = jnp.exp2(m - m_new)
                    l = l * alpha + p.sum(axis=1)
                    acc = ops.matmul_acc(acc * rows(alpha, acc.shape), p, v_smem)
                    return acc, m_new, l

                # A warpgroup skips the matmuls of a tile its own 64 rows cannot see (causality, window).
                seen = tile_visible(q_start, r, k_start, bk, plan)
                if seen is True:
                    acc, m, l = compute(acc, m, l)
                else:
                    acc, m, l = lax.cond(seen, compute, lambda *c: c, acc, m, l)
                return acc, m, l, q_start, q_seg_rows

            _stream_kv(step, context, tiles, n_kv, wgs, plan, dtype, d,
                       k_ref.at[batch, kv_head], v_ref.at[batch, kv_head], kseg_ref.at[batch])

        pl.run_scoped(with_scratch, _smem_tile((wgs, r, d), dtype), plgpu.SMEM((wgs, r), jnp.float32),
                      plgpu.SMEM((wgs, r), jnp.int32), [plgpu.Barrier(num_barriers=wgs)] * 2, collective_axes="wg")

    out, lse = _kernel(
        body, plan=plan, wgs=wgs, grid=(lq // bq, h, b), names=("rows", "heads", "batch"),
        out_type=[jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((b, h, lq), jnp.float32)],
        name=kernel_name("fwd", plan), args=(q, k, v, q_seg, kv_seg))
    return out, lse[..., None]


def backward(q, k, v, q_seg, kv_seg, lse, do, delta, plan: KernelPlan):
    """Gradients (dq, dk, dv) from the log-sum-exp, the output cotangent and delta, both [b, h, Lq, 1]."""
    lse2 = lse[..., 0] * LOG2E  # base-2, as the kernels exponentiate
    delta = delta[..., 0]
    dq = _dq(q, k, v, q_seg, kv_seg, do, lse2, delta, plan)
    dk, dv = _dkv(q, k, v, q_seg, kv_seg, do, lse2, delta, plan)
    return dq, dk, dv


def _dq(q, k, v, q_seg, kv_seg, do, lse2, delta, plan: KernelPlan):
    b, h, lq, d = q.shape
    lk = k.shape[2]
    bq, bk, dtype = plan.block_q, plan.block_k, q.dtype
    wgs, r = bq // ROWS_PER_WARPGROUP, ROWS_PER_WARPGROUP
    n_kv = lk // bk
    ops = HopperOps(plan.interpret)

    def body(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref, dq_ref):
        batch, head, block = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("rows")
        kv_head = lax.div(head, jnp.int32(plan.groups))
        tiles = kv_tiles(block, plan, n_kv)

        def with_scratch(q_smem2, do_smem2, lse_smem2, delta_smem2, seg_smem2, barriers):
            def context(pipeline):
                wg = lax.axis_index("wg")
                q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
                q_start = block * bq + wg * r
                rows_of = pl.ds(q_start, r)
                loads = [(q_ref.at[batch, head, rows_of], q_smem), (do_ref.at[batch, head, rows_of], do_smem),
                         (lse_ref.at[batch, head, rows_of], lse_smem2.at[wg]),
                         (delta_ref.at[batch, head, rows_of], delta_smem2.at[wg])]
                if plan.segments:
                    loads.append((qseg_ref.at[batch, rows_of], seg_smem2.at[wg]))
                _load_all(loads, barriers, wg)
                q_seg_rows = ops.load_rows(seg_smem2.at[wg]) if plan.segments else None
                stats = (ops.load_rows(lse_smem2.at[wg]), ops.load_rows(delta_smem2.at[wg]))
                dq, *_ = pipeline((ops.zeros((r, d)), q_start, q_seg_rows, stats))
                q_smem[...] = (dq * plan.scale).astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[batch, head, rows_of])
                plgpu.wait_smem_to_gmem(0)

            def step(indices, k_smem, v_smem, *rest):
                *kseg_smem, (dq, q_start, q_seg_rows, (lse_rows, delta_rows)) = rest
                k_start = (tiles[0] + indices[0]) * bk
                wg = lax.axis_index("wg")
                q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]

                def compute(dq):
                    k_seg = ops.load_cols(kseg_smem[0]) if plan.segments else None
                    s, keep, slope = _scores(ops, ops.matmul(q_smem, k_smem, (r, bk), transpose_b=True),
                                             q_start, k_start, q_seg_rows, k_seg, plan, transposed=False)
                    p = _masked(jnp.exp2(s - rows(lse_rows, s.shape)), keep)
                    dp = ops.matmul(do_smem, v_smem, (r, bk), transpose_b=True)
                    ds = _capped(p * (dp - rows(delta_rows, dp.shape)), slope)
                    return ops.matmul_acc(dq, ds, k_smem)

                seen = tile_visible(q_start, r, k_start, bk, plan)
                dq = compute(dq) if seen is True else lax.cond(seen, compute, lambda c: c, dq)
                return dq, q_start, q_seg_rows, (lse_rows, delta_rows)

            _stream_kv(step, context, tiles, n_kv, wgs, plan, dtype, d,
                       k_ref.at[batch, kv_head], v_ref.at[batch, kv_head], kseg_ref.at[batch])

        tile = _smem_tile((wgs, r, d), dtype)
        pl.run_scoped(with_scratch, tile, tile, plgpu.SMEM((wgs, r), jnp.float32), plgpu.SMEM((wgs, r), jnp.float32),
                      plgpu.SMEM((wgs, r), jnp.int32), [plgpu.Barrier(num_barriers=wgs)] * 5, collective_axes="wg")

    return _kernel(body, plan=plan, wgs=wgs, grid=(lq // bq, h, b), names=("rows", "heads", "batch"),
                   out_type=jax.ShapeDtypeStruct(q.shape, dtype), name=kernel_name("dq", plan),
                   args=(q, k, v, q_seg, kv_seg, do, lse2, delta))


def _dkv(q, k, v, q_seg, kv_seg, do, lse2, delta, plan: KernelPlan):
    b, _h, lq, d = q.shape
    kvh, lk = k.shape[1], k.shape[2]
    bk, g, dtype = plan.block_k, plan.groups, q.dtype
    # Each compute warpgroup owns 64 keys; the pipeline streams 64-row query tiles (two fp32
    # [64, 64] score tiles plus the dk, dv accumulators fit the registers).
    wgs, r, step_q = bk // ROWS_PER_WARPGROUP, ROWS_PER_WARPGROUP, ROWS_PER_WARPGROUP
    n_q = lq // step_q
    ops = HopperOps(plan.interpret)
    # The query heads of one K/V head are contiguous: view them as one [groups * Lq] sequence, which
    # the pipeline walks as (head of the group, row tile), so K/V are read once per program.
    q_g, do_g = (x.reshape(b, kvh, g * lq, d) for x in (q, do))
    lse_g, delta_g = (x.reshape(b, kvh, g * lq) for x in (lse2, delta))

    def body(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref):
        batch, kv_head, block = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("rows")

        def with_scratch(k_smem2, v_smem2, seg_smem2, barriers):
            def context(pipeline):
                wg = lax.axis_index("wg")
                k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
                k_start = block * bk + wg * r
                rows_of = pl.ds(k_start, r)
                loads = [(k_ref.at[batch, kv_head, rows_of], k_smem), (v_ref.at[batch, kv_head, rows_of], v_smem)]
                if plan.segments:
                    loads.append((kseg_ref.at[batch, rows_of], seg_smem2.at[wg]))
                _load_all(loads, barriers, wg)
                k_seg_rows = ops.load_rows(seg_smem2.at[wg]) if plan.segments else None
                dk, dv, *_ = pipeline((ops.zeros((r, d)), ops.zeros((r, d)), k_start, k_seg_rows))
                k_smem[...] = (dk * plan.scale).astype(dtype)
                v_smem[...] = dv.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[batch, kv_head, rows_of], commit_group=False)
                plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[batch, kv_head, rows_of], commit_group=False)
                plgpu.commit_smem_to_gmem_group()
                plgpu.wait_smem_to_gmem(0)

            def step(indices, q_smem, do_smem, lse_smem, delta_smem, *rest):
                *qseg_smem, (dk, dv, k_start, k_seg_rows) = rest
                q_start = (first + indices[1]) * step_q
                wg = lax.axis_index("wg")
                k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]

                def compute(dk, dv):
                    q_seg = ops.load_cols(qseg_smem[0]) if plan.segments else None
                    s, keep, slope = _scores(ops, ops.matmul(k_smem, q_smem, (r, step_q), transpose_b=True),
                                             q_start, k_start, q_seg, k_seg_rows, plan, transposed=True)
                    p = _masked(jnp.exp2(s - cols(ops.load_cols(lse_smem), s.shape)), keep)
                    dv = ops.matmul_acc(dv, p, do_smem)
                    dp = ops.matmul(v_smem, do_smem, (r, step_q), transpose_b=True)
                    ds = _capped(p * (dp - cols(ops.load_cols(delta_smem), dp.shape)), slope)
                    return ops.matmul_acc(dk, ds, q_smem), dv

                seen = tile_visible(q_start, step_q, k_start, r, plan)
                if seen is True:
                    dk, dv = compute(dk, dv)
                else:
                    dk, dv = lax.cond(seen, compute, lambda *c: c, dk, dv)
                return dk, dv, k_start, k_seg_rows

            # Query tiles wholly before this block's first key (causality) or past its window's reach are never
            # streamed: the trip count scales with the window.
            first, count = q_tiles(block, plan, n_q, step_q)
            q_spec = _tile_spec((step_q, d), dtype, lambda gi, i: (gi * n_q + first + i, 0))
            vec = plgpu.BlockSpec(block_shape=(step_q,), index_map=lambda gi, i: (gi * n_q + first + i,))
            seg = plgpu.BlockSpec(block_shape=(step_q,), index_map=lambda gi, i: (first + i,))
            specs = [q_spec, q_spec, vec, vec]
            refs = [q_ref.at[batch, kv_head], do_ref.at[batch, kv_head], lse_ref.at[batch, kv_head],
                    delta_ref.at[batch, kv_head]]
            if plan.segments:
                specs.append(seg)
                refs.append(qseg_ref.at[batch])
            pipeline = plgpu.emit_pipeline_warp_specialized(
                step, grid=(g, count), memory_registers=PRODUCER_REGISTERS, wg_axis="wg",
                num_compute_wgs=wgs, max_concurrent_steps=min(PIPELINE_STAGES, g * n_q), compute_context=context,
                in_specs=specs)
            pipeline(*refs)

        tile = _smem_tile((wgs, r, d), dtype)
        pl.run_scoped(with_scratch, tile, tile, plgpu.SMEM((wgs, r), jnp.int32), [plgpu.Barrier(num_barriers=wgs)] * 3,
                      collective_axes="wg")

    kv_type = jax.ShapeDtypeStruct(k.shape, dtype)
    return _kernel(body, plan=plan, wgs=wgs, grid=(lk // bk, kvh, b), names=("rows", "heads", "batch"),
                   out_type=[kv_type, kv_type], name=kernel_name("dkv", plan),
                   args=(q_g, k, v, q_seg, kv_seg, do_g, lse_g, delta_g))

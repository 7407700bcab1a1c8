"""`flash_attention`: validation, padding, layout and the custom VJP around the Pallas kernels."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from spmd_train.kernels.flash_attention import gpu_kernel, kernel
from spmd_train.kernels.flash_attention.gpu_ops import ROWS_PER_WARPGROUP
from spmd_train.kernels.flash_attention.kernel import KernelPlan


@dataclass(frozen=True)
class BlockSizes:
    """Rows per program (block_q) and the K/V tile each program steps through (block_k)."""

    block_q: int = 128
    block_k: int = 128


DEFAULT_BLOCKS = {"tpu": BlockSizes(512, 512), "gpu": BlockSizes(128, 128), "cpu": BlockSizes(128, 128)}
"""Per backend; "cpu" is the TPU kernels interpreted. On GPU block_q is two compute warpgroups of 64 rows."""
BACKENDS = ("tpu", "gpu")


def default_blocks(backend: str, interpret: bool, head_dim: int = 128) -> BlockSizes:
    """The block sizes used when none are given: per backend, smaller for the TPU kernels interpreted on CPU; on GPU
    the largest that fits a thread block's shared memory at this head width (wide heads such as MLA's 192 take
    64-key tiles)."""
    if backend == "gpu":
        return gpu_blocks_that_fit(head_dim) or GPU_BLOCK_CHOICES[-1]
    return DEFAULT_BLOCKS["cpu" if backend == "tpu" and interpret else backend]


GPU_SMEM_BYTES = 227 * 1024
"""Shared memory one thread block may use on Hopper (H100 and H200)."""
GPU_BLOCK_CHOICES = (BlockSizes(128, 128), BlockSizes(128, 64), BlockSizes(64, 64))
"""Default GPU blocks, fastest first (128 x 128 measured fastest at head_dim 128, docs/attention.md)."""


def gpu_blocks_that_fit(head_dim: int) -> BlockSizes | None:
    """The fastest of GPU_BLOCK_CHOICES whose kernels fit Hopper's shared memory at this head width (None: none)."""
    return next((b for b in GPU_BLOCK_CHOICES if gpu_smem_bytes(head_dim, b) <= GPU_SMEM_BYTES), None)


def gpu_smem_bytes(head_dim: int, blocks: BlockSizes, itemsize: int = 2) -> int:
    """Shared memory the largest of the three GPU kernels takes: each program's own rows (tiles and statistics) plus
    the streamed side's ring of `gpu_kernel.PIPELINE_STAGES` tiles, each buffer 1 KiB-aligned as swizzled tiles are,
    and 2 KiB for barriers: 251,904 bytes for the forward at head_dim 192 in 128 x 128 blocks, where Mosaic GPU counts
    250,944 (over the budget)."""
    def a(n):
        return _round_up(n, 1024)

    bq, bk, d = blocks.block_q, blocks.block_k, head_dim

    def ring(rows: int, vectors: int) -> int:  # two tiles (K and V, or Q and dO) and per-row vectors per stage
        return gpu_kernel.PIPELINE_STAGES * (2 * a(rows * d * itemsize) + vectors * a(rows * 4))

    forward = a(bq * d * itemsize) + 2 * a(bq * 4) + ring(bk, 1)
    dq = 2 * a(bq * d * itemsize) + 3 * a(bq * 4) + ring(bk, 1)
    dkv = 2 * a(bk * d * itemsize) + a(bk * 4) + ring(ROWS_PER_WARPGROUP, 3)
    return max(forward, dq, dkv) + 2048

TPU_VMEM_BUDGET = 32 * 2**20
"""Scoped VMEM these kernels may use on TPU (v5p reports 64 MiB; half leaves room for the compiler)."""


def tpu_vmem_bytes(q_shape, kv_shape, dtype, block_sizes: BlockSizes | None = None) -> int:
    """VMEM the kernels need on TPU for these per-device shapes (the largest of the three kernels).

    Both sides are tiled over the grid, so this depends on the block sizes (capped by the
    padded lengths) and head_dim, not on the sequence length: double-buffered input and
    output blocks plus fp32 scratch accumulators; row statistics take a full 128-lane row.
    """
    blocks = block_sizes or DEFAULT_BLOCKS["tpu"]
    _, lq, _, d = q_shape
    lk = kv_shape[1]
    isz = jnp.dtype(dtype).itemsize
    bq = min(blocks.block_q, _round_up(lq, 8))
    bk = min(blocks.block_k, _round_up(lk, 8))
    stat = 128 * 4  # a [rows, 1] fp32 block occupies whole lane rows
    forward = 2 * (2 * bq * d * isz + 2 * bk * d * isz + bq * stat + bk * 4) + 2 * bq * stat + bq * d * 4
    dq = 2 * (3 * bq * d * isz + 2 * bk * d * isz + 3 * bq * stat + bk * 4) + bq * d * 4
    dkv = 2 * (2 * bq * d * isz + 4 * bk * d * isz + 3 * bq * stat + bk * 4) + 2 * bk * d * 4
    return max(forward, dq, dkv)


def flash_attention(q, k, v, *, causal: bool = True, segment_ids=None, softmax_scale: float | None = None,
                    block_sizes: BlockSizes | None = None, return_lse: bool = False, interpret: bool | None = None,
                    backend: str | None = None, window: int | None = None, softcap: float | None = None,
                    q_offset: int = 0):
    """Attention of q [batch, lq, heads, head_dim] over k, v [batch, lk, kv_heads, head_dim].

    Grouped-query attention when kv_heads divides heads (K/V are never repeated). `segment_ids`:
    None, one [batch, length] int array for both sides (packed sequences), or a
    (q_segments [batch, lq], kv_segments [batch, lk]) pair. Query row r sits at position r + `q_offset`
    (static), key column c at c; causal attention without an offset needs lq == lk. `window`: a query
    sees only keys with q_pos - k_pos < window, and the kernels visit only the blocks that band touches;
    `softcap`: scores become softcap * tanh(scores / softcap) (`ops.attention.dot_product_attention`
    defines them all). Returns the output in q's dtype, and with `return_lse` also the fp32 log-sum-exp
    [batch, heads, lq] so blockwise results can be merged exactly. `backend` picks the kernels:
    "tpu" (Mosaic TPU) or "gpu" (Mosaic GPU, Hopper; bfloat16), by default the default device's.
    `interpret` defaults to True on CPU: the kernels then run on the host, slowly, for testing.
    """
    q_seg, kv_seg = _check(q, k, v, causal and not q_offset, segment_ids)
    if window is not None and window < 1:
        raise ValueError(f"window={window}: a query must see at least itself (valid: 1 or more, or None)")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap} must be positive (or None)")
    # Called alone, the default platform decides; the model passes both (`parallel.Backends`).
    device = jax.default_backend() if backend is None or interpret is None else None
    backend = backend or ("gpu" if device == "gpu" else "tpu")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not a flash-attention backend (valid: {', '.join(BACKENDS)})")
    interpret = device == "cpu" if interpret is None else interpret
    blocks = block_sizes or default_blocks(backend, interpret, q.shape[3])
    _b, lq, h, d = q.shape
    lk, kvh = k.shape[1], k.shape[2]
    if backend == "gpu":
        block_q, block_k = _gpu_blocks(q, k, blocks)
    else:
        block_q, block_k = _tpu_blocks(q, k, blocks, interpret)
    lq_pad, lk_pad = _round_up(lq, block_q), _round_up(lk, block_k)
    # Padded keys are masked by segment id -1 unless causality alone keeps every query off them.
    pads_seen = lk_pad != lk and (not causal or q_offset + lq > lk)
    plan = KernelPlan(scale=float(softmax_scale if softmax_scale is not None else d**-0.5), causal=causal,
                      block_q=block_q, block_k=block_k, q_len=lq, kv_len=lk, groups=h // kvh, interpret=interpret,
                      poison=kernel.poison_requested(), gpu=backend == "gpu",
                      segments=segment_ids is not None or pads_seen, window=window,
                      softcap=None if softcap is None else float(softcap), q_offset=int(q_offset))
    # [b, l, h, d] -> [b, h, l_padded, d]; padded keys get segment id -1 so nothing attends to them.
    qt = _pad(jnp.swapaxes(q, 1, 2), 2, lq_pad)
    kt = _pad(jnp.swapaxes(k, 1, 2), 2, lk_pad)
    vt = _pad(jnp.swapaxes(v, 1, 2), 2, lk_pad)
    qs = _pad(q_seg.astype(jnp.int32), 1, lq_pad)
    ks = _pad(kv_seg.astype(jnp.int32), 1, lk_pad, value=-1)
    if not plan.gpu:  # TPU tiling: segment ids as [b, lq, 1] and [b, 1, lk]
        qs, ks = qs[:, :, None], ks[:, None, :]
    out, lse = _attention(qt, kt, vt, qs, ks, plan)
    out = jnp.swapaxes(out[:, :, :lq], 1, 2)
    return (out, lse[:, :, :lq, 0]) if return_lse else out


def _tpu_blocks(q, k, blocks: BlockSizes, interpret: bool) -> tuple[int, int]:
    need = 0 if interpret else tpu_vmem_bytes(q.shape, k.shape, q.dtype, blocks)
    if need > TPU_VMEM_BUDGET:
        raise ValueError(f"q {q.shape} / k {k.shape} with {blocks} need {need / 2**20:.0f} MiB of TPU VMEM "
                         f"(budget {TPU_VMEM_BUDGET / 2**20:.0f} MiB): use smaller block_sizes")
    lq, lk = q.shape[1], k.shape[1]
    block_q = min(blocks.block_q, _round_up(lq, 8))
    block_k = min(blocks.block_k, _round_up(lk, 8))
    if not interpret and block_k < _round_up(lk, 8) and block_k % 128:
        # K/V tiles are sliced out of the segment-id row along TPU lanes: whole lane groups only.
        block_k = _round_up(block_k, 128)
    return block_q, block_k


def _gpu_blocks(q, k, blocks: BlockSizes) -> tuple[int, int]:
    """Block sizes for the Mosaic GPU kernels, which work in 64-row warpgroup tiles of bfloat16."""
    if q.dtype != jnp.bfloat16:
        raise ValueError(f"the GPU flash-attention kernels take bfloat16 (wgmma operands); got {q.dtype} for "
                         f"q {q.shape}: cast to bfloat16 or use backends.attention=xla")
    if q.shape[3] % 64:
        raise ValueError(f"the GPU flash-attention kernels need head_dim a multiple of 64; got {q.shape[3]} "
                         f"for q {q.shape}")
    for name, size in (("block_q", blocks.block_q), ("block_k", blocks.block_k)):
        if size % ROWS_PER_WARPGROUP or size > 4 * ROWS_PER_WARPGROUP:
            raise ValueError(f"GPU {name}={size}: must be 64, 128, 192 or 256 (64-row warpgroups, at most 4)")
    lq, lk = q.shape[1], k.shape[1]
    fitted = BlockSizes(min(blocks.block_q, _round_up(lq, ROWS_PER_WARPGROUP)),
                        min(blocks.block_k, _round_up(lk, ROWS_PER_WARPGROUP)))
    need = gpu_smem_bytes(q.shape[3], fitted)
    if need > GPU_SMEM_BYTES:
        fits = gpu_blocks_that_fit(q.shape[3])
        raise ValueError(f"GPU blocks {fitted.block_q} x {fitted.block_k} at head_dim {q.shape[3]} need "
                         f"{need / 1024:.0f} KiB of shared memory, over Hopper's {GPU_SMEM_BYTES // 1024} KiB: "
                         + (f"use block_sizes={fits}" if fits else "no block shape fits this head_dim"))
    return fitted.block_q, fitted.block_k


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, q_seg, kv_seg, plan):
    return tuple(_kernels(plan).forward(q, k, v, q_seg, kv_seg, plan))


def _kernels(plan: KernelPlan):
    return gpu_kernel if plan.gpu else kernel


def _attention_fwd(q, k, v, q_seg, kv_seg, plan):
    out, lse = _kernels(plan).forward(q, k, v, q_seg, kv_seg, plan)
    return (out, lse), (q, k, v, q_seg, kv_seg, out, lse)


def _attention_bwd(plan, residuals, cotangents):
    q, k, v, q_seg, kv_seg, out, lse = residuals
    d_out, d_lse = cotangents
    # delta_i = sum_d dO_i O_i enters dS = P (dP - delta). The log-sum-exp's cotangent (it matters
    # whenever blockwise results are merged, as in ring attention) adds d lse_i / d s_ij = P_ij,
    # i.e. it enters as delta_i - dlse_i. [b, h, Lq, 1] like the saved log-sum-exp, for both backends.
    f32 = jnp.float32
    delta = jnp.sum(out.astype(f32) * d_out.astype(f32), axis=-1, keepdims=True) - d_lse
    dq, dk, dv = _kernels(plan).backward(q, k, v, q_seg, kv_seg, lse, d_out, delta, plan)
    no_grad = [np.zeros(x.shape, jax.dtypes.float0) for x in (q_seg, kv_seg)]
    return dq, dk, dv, *no_grad


_attention.defvjp(_attention_fwd, _attention_bwd)


def _check(q, k, v, causal, segment_ids):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [batch, length, heads, head_dim]; "
                         f"got shapes {q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k {k.shape} and v {v.shape}")
    b, lq, h, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k/v {k.shape} do not match q {q.shape}: batch and head_dim must agree")
    if h % k.shape[2]:
        raise ValueError(f"k/v heads ({k.shape[2]}) must divide q heads ({h}) for grouped-query attention; "
                         f"q {q.shape}, k {k.shape}")
    if causal and k.shape[1] != lq:
        raise ValueError(f"causal attention needs equal q and k/v lengths; got q {q.shape}, k {k.shape}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in (jnp.float32, jnp.bfloat16):
            raise ValueError(f"{name} has dtype {x.dtype}; supported: float32, bfloat16")
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if segment_ids is None:
        return jnp.zeros((b, lq), jnp.int32), jnp.zeros((b, k.shape[1]), jnp.int32)
    q_seg, kv_seg = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
    if q_seg.shape != (b, lq) or kv_seg.shape != (b, k.shape[1]):
        raise ValueError(f"segment_ids must be [batch, length]: {(b, lq)} for q {q.shape} and {(b, k.shape[1])} "
                         f"for k/v {k.shape}; got {q_seg.shape} and {kv_seg.shape}")
    return q_seg, kv_seg


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad(x, axis: int, size: int, value=0):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)

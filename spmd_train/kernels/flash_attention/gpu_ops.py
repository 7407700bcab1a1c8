"""The few Hopper-specific operations the GPU flash-attention kernels use, with a CPU form of each.

On a GPU these are warpgroup matmuls (wgmma, accumulating in registers, B operand in swizzled
shared memory, transposed by the instruction itself) and loads or iotas in the register layout
wgmma produces. Mosaic GPU's CPU interpreter (which runs the kernels' copies, barriers,
pipelines and warpgroups on the host, so CI can prove them right) does not implement
transposed or register-operand wgmma nor layout-carrying loads, so `interpret=True` swaps in the
plain-array form of each; everything else in the kernels is the same code in both modes.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS_PER_WARPGROUP = 64
"""Rows one warpgroup owns: wgmma's M is 64 per warpgroup."""

# jax 0.10's `plgpu.load(ref, idx, ...)` requires the index; 0.11 deprecates passing it (the
# reference is indexed with `ref.at[...]` instead) and our tests turn deprecations into errors.
_LOAD_TAKES_INDEX = inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty


def _load(ref, layout):
    return plgpu.load(ref, (), layout=layout) if _LOAD_TAKES_INDEX else plgpu.load(ref, layout=layout)


@dataclass(frozen=True)
class HopperOps:
    """Register-level operations of the kernels; `interpret` selects the CPU forms."""

    interpret: bool

    def matmul(self, a, b, shape, *, transpose_b: bool = False):
        """a @ b (or a @ b^T) into a fresh fp32 [m, n] array; a and b are shared-memory refs."""
        if self.interpret:
            return _dot(a[...], b[...], transpose_b)
        rhs = b.transpose((1, 0)) if transpose_b else b

        def run(acc_ref):
            plgpu.wgmma(acc_ref, a, rhs)
            return acc_ref[...]

        return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))

    def matmul_acc(self, acc, a, b, *, transpose_b: bool = False):
        """acc + a @ b with acc fp32 in registers, a in registers (cast to b's dtype), b a shared-memory ref."""
        a = a.astype(b.dtype)
        if self.interpret:
            return acc + _dot(a, b[...], transpose_b)
        rhs = b.transpose((1, 0)) if transpose_b else b

        def run(acc_ref):
            plgpu.wgmma(acc_ref, a, rhs)

        return pl.run_state(run)(plgpu.ACC.init(acc))

    def zeros(self, shape):
        """fp32 zeros in the wgmma accumulator layout."""
        z = jnp.zeros(shape, jnp.float32)
        return z if self.interpret else plgpu.layout_cast(z, plgpu.Layout.WGMMA)

    def row_vector(self, value, rows: int):
        """A [rows] fp32 vector laid out like one value per accumulator row (statistics)."""
        v = jnp.full((rows,), value, jnp.float32)
        return v if self.interpret else plgpu.layout_cast(v, plgpu.Layout.WGMMA.reduce(1))

    def load_rows(self, ref):
        """A [rows] shared-memory vector as one value per accumulator row."""
        return ref[...] if self.interpret else _load(ref, plgpu.Layout.WGMMA.reduce(1))

    def load_cols(self, ref):
        """A [cols] shared-memory vector as one value per accumulator column."""
        return ref[...] if self.interpret else _load(ref, plgpu.Layout.WGMMA.reduce(0))

    def iota(self, shape, dim: int):
        """int32 indices along `dim` of an accumulator-shaped array."""
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def rows(x, shape):
    """Broadcast a per-row vector over an accumulator's columns."""
    return lax.broadcast_in_dim(x, shape, [0])


def cols(x, shape):
    """Broadcast a per-column vector over an accumulator's rows."""
    return lax.broadcast_in_dim(x, shape, [1])


def _dot(a, b, transpose_b: bool):
    dims = (((1,), (1 if transpose_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

"""MXFP4 (OCP microscaling FP4) tensors as gpt-oss's checkpoints store their experts, dequantized with numpy.

A packed tensor is two: `NAME_blocks` uint8 [..., rows, groups, 16], two 4-bit E2M1 values per byte (the low
nibble first), and `NAME_scales` uint8 [..., rows, groups], one power-of-two exponent (E8M0, bias 127) per 32
values. Each row is one output of the linear layer, its groups of 32 run along the input: the dequantized tensor is
[..., input, rows], the layout the unquantized checkpoints store (what `transformers`' convert_moe_packed_tensors
returns). Every value is an E2M1 value times a power of two, so bfloat16 holds it exactly.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BLOCKS, SCALES = "_blocks", "_scales"
"""The suffixes of a packed tensor's two parts."""
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
"""The 16 values of a 4-bit E2M1 code (sign bit, two exponent bits, one mantissa bit)."""


def dequantized_shape(blocks: tuple[int, ...]) -> tuple[int, ...]:
    """The dequantized tensor's shape for `NAME_blocks` of shape `blocks` [..., rows, groups, 16]."""
    *lead, rows, groups, width = blocks
    return (*lead, groups * width * 2, rows)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """`NAME_blocks` and `NAME_scales` as the bfloat16 tensor [..., input, rows] they encode."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.dtype}{list(blocks.shape)} and scales {scales.dtype}"
                         f"{list(scales.shape)} do not pair (valid: uint8 [..., rows, groups, 16] and uint8 "
                         "[..., rows, groups])")
    values = np.empty((*blocks.shape[:-1], blocks.shape[-1] * 2), np.float32)
    values[..., 0::2] = E2M1[blocks & 0x0F]
    values[..., 1::2] = E2M1[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    rows = values.reshape(*values.shape[:-2], -1)  # [..., rows, input]
    return np.swapaxes(rows, -1, -2).astype(ml_dtypes.bfloat16)

"""Which matmuls the layers trace, as the train step sets it: the compute dtype's, FP8 or int8 (precision.matmul),
and the dtype weight gradients are summed in (precision.reduce); read by `models.layers.dense` and the experts."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

MATMULS = ("default", "fp8", "fp8-row", "int8")
"""The modes (`config.precision_schema.matmul_mode`): the compute dtype's matmuls, FP8 ones at per-tensor scales
(`ops.fp8`) or at row scales, or int8 ones (`ops.rowwise`)."""
_MATMUL: contextvars.ContextVar[str] = contextvars.ContextVar("spmd_train_matmul", default="default")
_REDUCE: contextvars.ContextVar[str | None] = contextvars.ContextVar("spmd_train_reduce", default=None)


@contextlib.contextmanager
def use_matmul(mode: str, reduce: str | None = None) -> Iterator[None]:
    """Trace the matmuls inside with `mode` (one of MATMULS; precision.matmul) and their weight gradients summed
    across devices in `reduce` (precision.reduce; None: the compute dtype), as the train step does."""
    if mode not in MATMULS:
        raise ValueError(f"matmul mode {mode!r} is not one of {', '.join(MATMULS)}")
    tokens = _MATMUL.set(mode), _REDUCE.set(reduce)
    try:
        yield
    finally:
        _MATMUL.reset(tokens[0])
        _REDUCE.reset(tokens[1])


def matmul_in_use() -> str:
    """The mode `use_matmul` set around this trace ("default" outside one)."""
    return _MATMUL.get()


def reduce_in_use() -> str | None:
    """The gradient-sum dtype `use_matmul` set around this trace (None: the compute dtype)."""
    return _REDUCE.get()

"""Constrained value types the config sections share: single-key ranges live in the types.

pydantic names the key, the value and the bound when one is out of range.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

STRICT = ConfigDict(extra="forbid", strict=True)
"""Every section's pydantic config: unknown keys are errors and values are not coerced between types ("64" is not
an int)."""

DType = Literal["float32", "bfloat16", "float16"]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of each `DType` (what the analytic model counts with before jax starts)."""

# Sizes, counts and ids meet int32 on the devices (token ids, positions, the step counter); past int64 they
# would fail deep inside jax ("model.d_model=9223372036854775808": a TypeError), so the bound is the type's.
PositiveInt = Annotated[int, Field(ge=1, le=2**31 - 1)]
NonNegativeInt = Annotated[int, Field(ge=0, le=2**31 - 1)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Fraction = Annotated[float, Field(ge=0, le=1)]
"""A float in [0, 1]."""
Decay = Annotated[float, Field(ge=0, lt=1)]
"""A moment decay rate in [0, 1)."""
MAX_STEPS = 2**31 - 1
"""The step counter is int32 on the devices."""

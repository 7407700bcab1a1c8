"""The `precision` section: the numeric policy beside `model.param_dtype` and `model.compute_dtype`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from spmd_train.config.field_types import STRICT, PositiveFloat, PositiveInt


@dataclass(frozen=True)
class PrecisionConfig:
    """What precision each copy of the weights and the optimizer's state is kept in."""

    __pydantic_config__ = STRICT

    master: Literal["none", "float32"] = "none"
    """float32: keep a float32 master copy of bfloat16 parameters (model.param_dtype=bfloat16) in the optimizer state;
    the optimizer updates the master copy (its moments in float32 too) and the parameters are its bfloat16 rounding,
    so small updates accumulate instead of rounding away: 2 + 2 + 12 bytes per parameter as in the ZeRO paper
    (Rajbhandari et al. 2020, §3.1). none: the optimizer updates the stored parameters and keeps its moments in their
    dtype."""
    loss_scale: Literal["none", "dynamic"] = "none"
    """dynamic: multiply the objective by a scale before the backward pass and divide the gradients by it, halving the
    scale when they overflow (the step is skipped) and doubling it after loss_scale_growth_interval good steps: what
    model.compute_dtype=float16 needs (float16's gradients underflow otherwise). none: no scaling."""
    loss_scale_init: PositiveFloat = 65536.0
    """The dynamic loss scale a run starts with (PyTorch's GradScaler default, 2^16)."""
    loss_scale_growth_interval: PositiveInt = 2000
    """Applied steps in a row after which the dynamic loss scale doubles (GradScaler's default)."""

"""optim.name=lion: the sign of an interpolated momentum (Chen et al. 2023, "Symbolic Discovery of Optimization
Algorithms"), `optax.lion`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optax

from spmd_train.config.train_schema import OptimConfig
from spmd_train.train.optimizer_registry import Optimizer, register_optimizer


def build_lion(cfg: OptimConfig, lr: optax.Schedule, mask: Any,
               moments: Mapping[str, float | None], logical: Any) -> optax.GradientTransformation:
    """One momentum in the parameter dtype; weight decay lr_t * weight_decay * p on the masked parameters."""
    return optax.lion(lr, b1=moments["b1"], b2=moments["b2"], weight_decay=cfg.weight_decay, mask=mask)


register_optimizer(Optimizer("lion", build_lion))

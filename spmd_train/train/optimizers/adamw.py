"""optim.name=adamw: Adam with decoupled weight decay (Loshchilov & Hutter 2019), `optax.adamw`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optax

from spmd_train.config.train_schema import OptimConfig
from spmd_train.train.optimizer_registry import Optimizer, register_optimizer


def build_adamw(cfg: OptimConfig, lr: optax.Schedule, mask: Any,
                moments: Mapping[str, float | None], logical: Any) -> optax.GradientTransformation:
    """Two moments in the parameter dtype; weight decay lr_t * weight_decay * p on the masked parameters."""
    return optax.adamw(lr, b1=moments["b1"], b2=moments["b2"], eps=moments["eps"], weight_decay=cfg.weight_decay,
                       mask=mask)


register_optimizer(Optimizer("adamw", build_adamw))

"""optim.name=adafactor: factored second moments (Shazeer & Stern 2018), `optax.adafactor` with its defaults."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optax

from spmd_train.config.train_schema import OptimConfig
from spmd_train.train.optimizer_registry import Optimizer, register_optimizer


def build_adafactor(cfg: OptimConfig, lr: optax.Schedule, mask: Any,
                    moments: Mapping[str, float | None], logical: Any) -> optax.GradientTransformation:
    """Row and column second moments per matrix (a momentum only with optim.b1 set), decay as AdamW's."""
    # optax.adafactor adds its decay after the learning rate has scaled the update: scaling the rate by the
    # schedule makes it AdamW's. A callable rate also keeps the state's structure whatever weight_decay is.
    return optax.adafactor(lr, momentum=moments["b1"], weight_decay_rate=lambda t: cfg.weight_decay * lr(t),
                           weight_decay_mask=mask)


register_optimizer(Optimizer("adafactor", build_adafactor))

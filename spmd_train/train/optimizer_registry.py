"""The optimizers' optax transformations, by name: one `Optimizer` each, registered by its own module.

The facts of each optimizer (its moment settings and defaults, its state bytes for the planner) are
`config.optimizer_facts`'; the code that builds its optax transformation is registered here under the same
name by a module of `train.optimizers`, whose package imports them all (look optimizers up through it).
`train.optimizer.make_optimizer` wraps it with clipping, the learning-rate schedule and the decay mask.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import optax

from spmd_train.config.train_schema import OptimConfig
from spmd_train.registry import Registry

Build = Callable[[OptimConfig, optax.Schedule, Any, Mapping[str, float | None], Any], optax.GradientTransformation]
"""build(cfg, lr, mask, moments, logical): the transformation for optim section `cfg`, learning rate `lr` (a schedule
of the applied step), weight decay on the parameters `mask` marks, b1/b2/eps resolved (`train.optimizer.
hyperparameters`: the ones it reads, defaults filled in), and the parameters' logical axes (a tree of
PartitionSpecs, for an optimizer that treats parameters by kind, as Muon does)."""


@dataclass(frozen=True)
class Optimizer:
    """An optimizer's code: how to build its optax transformation (decoupled weight decay included)."""

    name: str
    """optim.name's value; its `config.optimizer_facts.OptimizerFacts` has the same name."""
    build: Build


_OPTIMIZERS: Registry[Optimizer] = Registry("optimizer")
register_optimizer = _OPTIMIZERS.add
"""Add an optimizer's transformation (ValueError for a name already taken)."""


def optimizer_named(name: str) -> Optimizer:
    """The optimizer registered as `name` (KeyError for an unknown name: the schema refuses those first)."""
    return _OPTIMIZERS[name]


def registered_optimizers() -> tuple[str, ...]:
    """The names with a registered transformation, in registration order."""
    return _OPTIMIZERS.names()

"""The optimizers' optax transformations, one module each; importing this package registers every one of them.

A module defines its build function and registers `Optimizer(name, build)`; its facts are registered under the
same name in `config.optimizer_facts` (docs/howto/add-an-optimizer.md).
"""

from spmd_train.train.optimizer_registry import Optimizer, optimizer_named, registered_optimizers
from spmd_train.train.optimizers import (  # noqa: F401 (importing a module registers its optimizer)
    adafactor,
    adamw,
    lion,
    muon,
)

__all__ = ["Optimizer", "optimizer_named", "registered_optimizers"]

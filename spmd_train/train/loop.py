"""`train(cfg)`: the whole run in one call (what `spmd-train train` does)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax

from spmd_train.config.schema import Config
from spmd_train.train.engine import TrainState
from spmd_train.train.trainer import Trainer


@dataclass(frozen=True)
class TrainResult:
    """What a finished (or signal-stopped) run hands back."""

    state: TrainState
    history: list[dict[str, Any]]
    compile_time_s: float
    loss_floor: float | None
    """Best achievable loss on the training data (nats per token), where known."""
    stopped_by: str | None
    """'SIGTERM' or 'SIGINT' if the run stopped early on a signal (after saving), else None."""
    trained: int = 0
    """Steps this call took (0: the run was already at train.steps)."""


def train(cfg: Config, devices: list[jax.Device] | None = None) -> TrainResult:
    """Init (or resume), train to `train.steps`, save, and return the state and metrics."""
    trainer = Trainer(cfg, devices)
    try:
        trainer.init()
        new = trainer.run()
    finally:
        trainer.close()
    return TrainResult(trainer.state, trainer.history, trainer.compile_time_s or 0.0, trainer.data.loss_floor,
                       trainer.stopped_by_signal, len(new))

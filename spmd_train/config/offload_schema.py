"""The `offload` section: what the run keeps in the host's memory instead of the accelerator's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import Field

from spmd_train.config.field_types import STRICT, PositiveInt

OffloadFraction = Annotated[float, Field(gt=0, le=1)]
"""A share of the optimizer state's bytes in (0, 1]."""

MAX_GROUPS = 64
"""The most slices `offload.optimizer_groups=null` picks."""

HOST_MEMORY_KIND = "pinned_host"
"""The memory kind offloaded arrays live in: page-locked host memory, which the device reads and writes by DMA."""


@dataclass(frozen=True)
class OffloadConfig:
    """Host memory instead of device memory: the optimizer state (moments, and the float32 master copy), and the
    layer stack's parameters."""

    __pydantic_config__ = STRICT

    optimizer: bool | OffloadFraction = False
    """true: the optimizer state (every parameter-shaped array of it: the moments and precision.master's float32 copy)
    lives in pinned host memory and streams through the device in `optimizer_groups` slices for each step's update; a
    fraction in (0, 1]: that share of its bytes (whole arrays, the layer stack's first), the rest stays on the device,
    as Megatron's --optimizer-offload-fraction. Needs an optimizer whose update is elementwise (adamw, lion). false:
    all on the device."""
    optimizer_groups: PositiveInt | None = None
    """How many slices the offloaded state streams through the device in (each array is cut along a dimension it is
    not split on and that the groups divide: the layer stack's layers, a table's rows; an array with none is updated
    whole): the device holds about 2/groups of the state at a time, one slice updating while the next arrives. null:
    one per layer of the stack (model.num_layers' stored rows), at most 64."""

    params: bool = False
    """true: the layer stack's parameters live in pinned host memory; the layer loop brings each layer's to the
    device as it reaches it (in the forward pass and again for the backward's recompute); their gradients are made
    and kept in host memory, and the update streams parameters and gradients through the device with the optimizer
    state. Needs offload.optimizer (true or a fraction), a parallel.remat policy other than none (which would keep
    every fetched layer), no pipeline, and no dynamic loss scale. false: on the device."""

    @property
    def optimizer_share(self) -> float:
        """The share of the optimizer state's bytes kept on the host (0: none)."""
        return float(self.optimizer) if not isinstance(self.optimizer, bool) else 1.0 if self.optimizer else 0.0


def optimizer_groups(given: int | None, stack_rows: int) -> int:
    """The slices the offloaded optimizer state streams in: offload.optimizer_groups as `given`, or one per stored row
    of the layer stack, at most MAX_GROUPS (the engine's `train.offload` and the planner's memory model both ask)."""
    return given or max(1, min(stack_rows, MAX_GROUPS))

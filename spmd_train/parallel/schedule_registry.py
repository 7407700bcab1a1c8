"""The op orders of the pipeline schedules, by name: one `ScheduleOrder` each, registered by its own module.

The facts of each schedule (placement, split backward, chunks and microbatches it needs) are
`config.schedule_facts`'; the code that orders its ops is registered here under the same name by a module of
`parallel.pipeline_schedules`, whose package imports them all (look schedules up through it). Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from spmd_train.registry import Registry

OpTuple = tuple[str, int, int]
"""(kind, microbatch, chunk): "F", "B" or "W" of one microbatch on one chunk; equal to and hashed like
`schedules.Op`."""
Inputs = Callable[[OpTuple], Iterable[OpTuple]]
"""The ops whose outputs an op consumes (`schedules.op_inputs`), for orders that simulate as they go."""
Orders = Callable[[int, int, int, Inputs], list[list[OpTuple]]]
"""orders(stages, microbatches, virtual, inputs): each stage's ops in the order it runs them."""


@dataclass(frozen=True)
class ScheduleOrder:
    """A pipeline schedule's code: the function that orders each stage's ops (`build_schedule` list-schedules them)."""

    name: str
    """parallel.pipeline_schedule's value; its `config.schedule_facts.ScheduleFacts` has the same name."""
    orders: Orders
    """Each stage's op order for the counts `config.validity.schedule_request` accepted for this schedule."""


_ORDERS: Registry[ScheduleOrder] = Registry("pipeline schedule")
register_schedule = _ORDERS.add
"""Add a schedule's op order (ValueError for a name already taken)."""


def schedule_order(name: str) -> ScheduleOrder:
    """The op order registered as `name` (KeyError for an unknown name: `schedule_request` refuses those first)."""
    return _ORDERS[name]


def registered_orders() -> tuple[str, ...]:
    """The names with a registered op order, in registration order."""
    return _ORDERS.names()

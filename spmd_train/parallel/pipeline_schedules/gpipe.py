"""GPipe (Huang et al. 2019): all forwards, then all backwards; every stage holds all m activations at the turn."""

from __future__ import annotations

from spmd_train.parallel.schedule_registry import Inputs, OpTuple, ScheduleOrder, register_schedule


def gpipe_orders(p: int, m: int, v: int, inputs: Inputs) -> list[list[OpTuple]]:
    """Stage s: F(0..m-1, s), then B(0..m-1, s) (one chunk per stage)."""
    return [[("F", i, s) for i in range(m)] + [("B", i, s) for i in range(m)] for s in range(p)]


register_schedule(ScheduleOrder("gpipe", gpipe_orders))

"""Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): v chunks per device, device d holding chunks d, d+p, ...;
microbatches in groups of p sweep the device's chunks in turn."""

from __future__ import annotations

from spmd_train.parallel.pipeline_schedules.one_f_one_b import one_forward_one_backward
from spmd_train.parallel.schedule_registry import Inputs, OpTuple, ScheduleOrder, register_schedule


def interleaved_orders(p: int, m: int, v: int, inputs: Inputs) -> list[list[OpTuple]]:
    """Megatron-LM's op order for each of p devices (m a multiple of p, v >= 2)."""
    return [_device_order(d, p, m, v) for d in range(p)]


def _device_order(d: int, p: int, m: int, v: int) -> list[OpTuple]:
    """Device d: groups of p microbatches sweep its v chunks in turn."""
    groups = range(m // p)
    forwards = [("F", g * p + i, d + k * p) for g in groups for k in range(v) for i in range(p)]
    backwards = [("B", g * p + i, d + k * p) for g in groups for k in reversed(range(v)) for i in range(p)]
    # Megatron's warm-up. The first backward (microbatch 0 on the last local chunk) waits for the
    # first group's forwards on the v-1 earlier local chunks ((v-1)*p ops), then for its forward to
    # reach the last device and its gradient to come back (2 ticks per downstream device).
    # Checked, not assumed: with this plain order, list scheduling attains 2(v*m+p-1) ticks.
    warmup = min((p - d - 1) * 2 + (v - 1) * p, m * v)
    return one_forward_one_backward(forwards, backwards, warmup)


register_schedule(ScheduleOrder("interleaved_1f1b", interleaved_orders))

"""1F1B (PipeDream-Flush, Narayanan et al. 2021): p-s-1 warm-up forwards on stage s, then one forward and one
backward in turn, so stage s never holds more than p-s activations."""

from __future__ import annotations

from spmd_train.parallel.schedule_registry import Inputs, OpTuple, ScheduleOrder, register_schedule


def one_f_one_b_orders(p: int, m: int, v: int, inputs: Inputs) -> list[list[OpTuple]]:
    """Stage s: 1F1B with p-s-1 warm-up forwards (one chunk per stage)."""
    return [one_forward_one_backward([("F", i, s) for i in range(m)], [("B", i, s) for i in range(m)],
                                     warmup=p - s - 1) for s in range(p)]


def one_forward_one_backward(forwards: list[OpTuple], backwards: list[OpTuple], warmup: int) -> list[OpTuple]:
    """`warmup` forwards, then alternate one forward and one backward, then the remaining backwards."""
    steady = len(forwards) - warmup
    order = forwards[:warmup]
    for i in range(steady):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[steady:]


register_schedule(ScheduleOrder("1f1b", one_f_one_b_orders))

"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Sec. 3.1 and Fig. 3): the backward split into B
(input gradient, which the previous stage waits for) and W (weight gradient, which nothing waits for).

1F1B's warm-up, then B, W, F per steady step with stage s's W trailing its B by s microbatches, and the s+1
deferred W's filling the cooldown. Bubble (p-1)(T_F+T_B-T_W) per stage against 1F1B's (p-1)(T_F+T_B+T_W): with
T_F = T_B = T_W, (p-1) units against 3(p-1).
"""

from __future__ import annotations

from spmd_train.parallel.schedule_registry import Inputs, OpTuple, ScheduleOrder, register_schedule


def zb_h1_orders(p: int, m: int, v: int, inputs: Inputs) -> list[list[OpTuple]]:
    """ZB-H1's op order for each of p stages and m >= p microbatches (one chunk per stage)."""
    return [_stage_order(s, p, m) for s in range(p)]


def _stage_order(s: int, p: int, m: int) -> list[OpTuple]:
    # 1F1B's p-s-1 warm-up forwards plus its first steady one: stage s holds p-s activations whole.
    warm = min(p - s, m)
    order: list[OpTuple] = [("F", i, s) for i in range(warm)]
    for i in range(m):
        order.append(("B", i, s))
        # W trails B by s microbatches: the last stage must finish its B's s+1 W's early so that every
        # stage above it can end on B, W at the same time (the cooldown that 1F1B leaves idle).
        if i >= s:
            order.append(("W", i - s, s))
        if i + warm < m:
            order.append(("F", i + warm, s))
    return order + [("W", i, s) for i in range(max(m - s, 0), m)]


register_schedule(ScheduleOrder("zb_h1", zb_h1_orders))

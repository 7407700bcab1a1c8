"""MoE capacity: how many slots each expert has per group. Pure Python (no jax): the planner counts with it too."""

from __future__ import annotations

import math


def capacity(k: int, tokens_in_group: int, capacity_factor: float, num_experts: int) -> int:
    """Slots per expert and group: ceil(k * tokens_in_group * capacity_factor / num_experts).

    The product is evaluated left to right in Python floats and rounded up, so a capacity
    factor of 1.0 with balanced routing never drops, and capacity is at least 1 for any
    positive factor. This rounding is part of the contract: tests and the planner rely on it.
    """
    return math.ceil(k * tokens_in_group * capacity_factor / num_experts)


def devices_reached(k: int, ways: int, num_experts: int, n_group: int = 1, topk_group: int = 1) -> int:
    """The most `expert`-axis devices (of `ways`, each holding num_experts / ways consecutive experts) one token's k
    choices can span: k, or the devices its `topk_group` groups of num_experts / n_group consecutive experts cover
    under group-limited routing (topk_group < n_group), whichever is fewer."""
    bound = min(k, ways)
    if topk_group < n_group:
        per_device, per_group = num_experts // ways, num_experts // n_group
        if per_group % per_device == 0:
            span = per_group // per_device
        elif per_device % per_group == 0:
            span = 1
        else:  # a group may straddle one more device boundary than its width covers
            span = math.ceil(per_group / per_device) + 1
        bound = min(bound, topk_group * span)
    return bound


def device_capacity(k: int, tokens_in_group: int, capacity_factor: float, ways: int, num_experts: int,
                    n_group: int = 1, topk_group: int = 1) -> int:
    """Rows per destination device and group under deduplicated dispatch (backends.moe=capacity_dedup): each token is
    sent once to each device holding any of its experts, at most `devices_reached` of them, so
    ceil(reached x tokens_in_group x capacity_factor / ways)."""
    reached = devices_reached(k, ways, num_experts, n_group, topk_group)
    return math.ceil(reached * tokens_in_group * capacity_factor / ways)

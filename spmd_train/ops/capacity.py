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

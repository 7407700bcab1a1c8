"""How ulysses splits attention heads over `sequence`. Pure Python (no jax): the planner counts with it too."""

from __future__ import annotations

import math


def kv_repeats(kv_heads: int, ways: int) -> int:
    """How many times ulysses repeats each K/V head so that `ways` devices get whole, aligned groups."""
    return math.lcm(kv_heads, ways) // kv_heads

"""Byte units and how reports print them. Pure Python (no jax): the planner and the config checks print with it."""

from __future__ import annotations

GiB = 2**30


def human_bytes(n: float | None) -> str:
    """1536 -> '1.50 KiB'; None -> 'unknown'."""
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def gib_apart(need: float, limit: float) -> tuple[str, str]:
    """Two byte counts in GiB with the fewest decimals (1 to 4) that tell them apart: a need just above a limit
    reads '74.53 GiB > 74.50 GiB', not '74.5 GiB > 74.5 GiB'."""
    for digits in range(1, 5):
        a, b = f"{need / GiB:.{digits}f}", f"{limit / GiB:.{digits}f}"
        if a != b:
            break
    return f"{a} GiB", f"{b} GiB"

"""Simulated CPU devices (`run.simulate_devices`): must take effect before jax initialises."""

from __future__ import annotations

import jax

from spmd_train.errors import ConfigError


def simulate_devices(count: int | None) -> None:
    """Run on `count` simulated CPU devices; a no-op for None or when jax already has exactly that."""
    if count is None:
        return
    try:
        jax.config.update("jax_num_cpu_devices", count)
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:
        have = jax.devices()
        if len(have) != count or have[0].platform != "cpu":
            raise ConfigError(
                f"run.simulate_devices={count} cannot take effect: jax is already running on {len(have)} "
                f"{have[0].platform} devices. Call spmd_train.simulate_devices({count}) before any jax "
                "computation (first cell of a notebook), or set run.simulate_devices=null to use the real devices"
            ) from None

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


def start_distributed(run) -> None:
    """Join JAX's multi-controller runtime when the config asks for it; must precede any jax computation.

    On CPU (simulated devices) the processes exchange data over gloo, so the same multi-process
    code runs on one machine. A lost process is detected by JAX's coordination service, not by
    code of ours: every process sends it heartbeats, and after `run.peer_timeout_s` without one
    the service ends every other process (non-zero exit, "The following tasks are unhealthy
    (stopped sending heartbeats): K", K the lost `run.process_id`). When process 0, which hosts
    the service, is the one lost, the others end at once on the closed connection.
    """
    if run.coordinator is None and not run.distributed:
        return
    if run.simulate_devices is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if run.coordinator is not None:
        jax.distributed.initialize(coordinator_address=run.coordinator, num_processes=run.num_processes,
                                   process_id=run.process_id, heartbeat_timeout_seconds=run.peer_timeout_s)
    else:
        jax.distributed.initialize(heartbeat_timeout_seconds=run.peer_timeout_s)

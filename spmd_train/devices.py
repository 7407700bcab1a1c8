"""Simulated CPU devices (`run.simulate_devices`): must take effect before jax initialises."""

from __future__ import annotations

import glob
import importlib.util
import os
import pkgutil

import jax

from spmd_train.errors import ConfigError


def simulate_devices(count: int | None) -> None:
    """Run on `count` simulated CPU devices, or (None) on the real ones; a no-op when jax already has exactly that."""
    if count is None:
        skip_absent_tpu()
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


def skip_absent_tpu() -> None:
    """Keep jax from starting its TPU backend on a host with libtpu installed (the tpu-aot extra, which compiles for
    TPU slices elsewhere) but no TPU: that start fails, after printing libtpu's lookup errors, on every run.

    Nothing changes where the user chose the platforms (JAX_PLATFORMS), where libtpu is absent, or on a TPU host
    (its device files or the TPU VM's variables). GPUs stay visible where their plugin and device files are.
    """
    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or importlib.util.find_spec("libtpu") is None:
        return
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") or os.environ.get("TPU_ACCELERATOR_TYPE"):
        return
    plugins = {m.name for m in pkgutil.iter_modules() if m.name.startswith("jax_") and m.name.endswith("_plugin")}
    gpus = (("cuda", "jax_cuda", "/dev/nvidiactl"), ("rocm", "jax_rocm", "/dev/kfd"))
    platforms = [name for name, prefix, device in gpus
                 if any(p.startswith(prefix) for p in plugins) and os.path.exists(device)]
    try:
        jax.config.update("jax_platforms", ",".join([*platforms, "cpu"]))
    except RuntimeError:
        pass  # jax has started already: its backends are what they are


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

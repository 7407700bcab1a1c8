"""Whether a run's parameters, gradients and optimizer state can exist on its devices, checked before compiling.

XLA aborts the process (a failed CHECK in its heap simulator, exit 134) when asked to compile a
state of absurd size (`model.d_model=1000000000`), and a state that merely exceeds the devices
runs out of memory only after minutes of compiling. The state's bytes per device follow from the
shapes and shardings alone, so both are refused at once with the figure and what would fit.
Activations and temporaries come on top: `spmd-train describe` reports them from the compiled step.
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax

from spmd_train.errors import ConfigError
from spmd_train.hardware import device_spec

GiB = 2**30
NO_DEVICE_HOLDS = 2**40
"""Per-device state bytes no accelerator holds (the largest have about 0.3 TiB)."""


def bytes_per_device(shapes: Any, shardings: Any) -> int:
    """Bytes one device stores of a tree of ShapeDtypeStructs split by a matching tree of shardings."""
    total = 0
    for shape, sharding in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings), strict=True):
        total += math.prod(sharding.shard_shape(shape.shape)) * shape.dtype.itemsize
    return total


def describe_run(cfg: Any, mesh_shape: dict[str, int]) -> str:
    """The keys that decide the state's size, for the error message."""
    m = cfg.model
    axes = " x ".join(f"{a} {n}" for a, n in mesh_shape.items() if n > 1) or "one device"
    return (f"model.num_layers={m.num_layers}, d_model={m.d_model}, d_ff={m.d_ff}, vocab_size={m.vocab_size}, "
            f"param_dtype={m.param_dtype}, parallel.zero_stage={cfg.parallel.zero_stage} on mesh {axes}")


def check_state_fits(need: int, device: jax.Device, run: str, *, allocating: bool, local_devices: int = 1) -> None:
    """ConfigError naming `run` (`describe_run`) when `need` bytes of state per device cannot fit: over the device
    kind's memory (when known), over what any device holds, or, when `allocating` on CPU, over this host's memory
    for its local devices."""
    what = f"{run}: the parameters, gradients and optimizer state need {need / GiB:,.2f} GiB per device"
    fix = ("valid: a smaller model (model.*), more devices on the axes that split the state (mesh.fsdp with "
           "parallel.zero_stage=3 divides all three, mesh.tensor the matrices), or bfloat16 parameters "
           "(model.param_dtype)")
    spec = device_spec(device.device_kind)
    if spec is not None and need > spec.hbm_bytes:
        raise ConfigError(f"{what}, more than the {spec.hbm_bytes / GiB:.0f} GiB of a {spec.name} ({fix})")
    if need > NO_DEVICE_HOLDS:
        raise ConfigError(f"{what}, more than any device holds ({fix})")
    if allocating and device.platform == "cpu":
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if need * local_devices > host:
            raise ConfigError(f"{what}, {need * local_devices / GiB:,.2f} GiB for this host's {local_devices} "
                              f"simulated devices, more than its {host / GiB:.1f} GiB of memory ({fix})")

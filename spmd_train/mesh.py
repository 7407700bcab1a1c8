"""Devices -> a named `jax.sharding.Mesh` over the six public axes."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from spmd_train.config.mesh_schema import MESH_AXES, MeshConfig
from spmd_train.errors import ConfigError


def resolve_axis_sizes(mesh_cfg: MeshConfig, num_devices: int) -> dict[str, int]:
    """Fill the -1 axis so the product of sizes equals num_devices; error if that is impossible."""
    sizes = mesh_cfg.sizes()
    fixed = math.prod(s for s in sizes.values() if s != -1)
    filled = [a for a, s in sizes.items() if s == -1]
    if filled:
        if num_devices % fixed:
            raise ConfigError(
                f"mesh.{filled[0]}=-1 cannot be filled: the other axes ({_describe(sizes)}) multiply to "
                f"{fixed}, which does not divide the {num_devices} devices (valid: axis sizes whose product "
                f"divides {num_devices})"
            )
        sizes[filled[0]] = num_devices // fixed
    if math.prod(sizes.values()) != num_devices:
        raise ConfigError(
            f"mesh axes {_describe(sizes)} multiply to {math.prod(sizes.values())}, but there are "
            f"{num_devices} devices (valid: sizes whose product is {num_devices}, or one axis set to -1)"
        )
    return sizes


def build_mesh(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build the Mesh with `tensor` innermost (fastest links) and slow-link factors outermost.

    Axes are Auto: the compiler partitions everything outside explicit `shard_map` regions.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_axis_sizes(mesh_cfg, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    dcn = tuple(getattr(mesh_cfg.dcn, a) for a in MESH_AXES)
    granules = _num_granules(devices)
    if math.prod(dcn) > 1 and granules > 1:
        if math.prod(dcn) != granules:
            raise ConfigError(
                f"mesh.dcn factors {dict(zip(MESH_AXES, dcn, strict=True))} multiply to {math.prod(dcn)}, "
                f"but the devices "
                f"form {granules} slices/hosts (valid: factors whose product is {granules})"
            )
        ici = tuple(s // f for s, f in zip(shape, dcn, strict=True))
        device_array = mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, process_is_granule=not hasattr(devices[0], "slice_index")
        )
    elif len(devices) == 1:
        device_array = np.array(devices).reshape(shape)
    else:
        # One host or slice: slow-link factors have no physical meaning here; the slow axes are
        # already outermost, so plain topology-aware ordering gives the same logical layout.
        device_array = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _num_granules(devices: Sequence[jax.Device]) -> int:
    slices = {getattr(d, "slice_index", None) for d in devices}
    if len(slices) > 1:
        return len(slices)
    return len({d.process_index for d in devices})


def _describe(sizes: dict[str, int]) -> str:
    return " x ".join(f"{a}={s}" for a, s in sizes.items())

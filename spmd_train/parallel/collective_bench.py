"""Timing the collectives the planner models, over one mesh axis at a time, and a matmul throughput probe.

`bench-collectives` calibrates the planner's α-β model with these figures (`analysis.plan.profile`). Each
collective runs in a `shard_map` over every mesh axis, exchanging over one of them; message sizes follow
NCCL-tests' "size" (the larger of the op's per-device buffers), in float32 on every platform.

Details: docs/explanation/planner-model.md#calibrating-from-a-measured-profile
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmd_train.hardware import device_spec

OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
"""The collectives timed, by the names the planner's `CommTerm.op` uses."""
DTYPE = jnp.float32
ITEMSIZE = 4


@dataclass(frozen=True)
class Timed:
    """One collective's median time over one axis at one message size."""

    op: str
    axis: str
    group: int
    """Devices in one group of the collective (the axis's size)."""
    bytes: int
    """Message size per device (NCCL-tests' "size", per op: docs/explanation/planner-model.md)."""
    seconds: float
    """Median of `repeats` runs, each blocked until its output is ready."""
    repeats: int


@dataclass(frozen=True)
class MatmulProbe:
    """Sustained matmul throughput of one device, and its fraction of the table's dense peak where known."""

    device_kind: str
    dtype: str
    size: int
    """The square matmul's side: (size x size) @ (size x size)."""
    seconds: float
    flops_per_second: float
    peak: float | None
    """The dense bf16 peak of `device_spec(device_kind)`; None where the table does not know the device (CPU)."""
    devices: int = 1
    """Devices that multiplied at once (`flops_per_second` is per device)."""

    @property
    def fraction(self) -> float | None:
        """Measured FLOP/s over the peak; None where the peak is unknown."""
        return self.flops_per_second / self.peak if self.peak else None


def message_elements(op: str, nbytes: int, group: int) -> tuple[int, int]:
    """(input, output) float32 elements per device for a message of `nbytes` (rounded down to whole chunks)."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r} (valid: {', '.join(OPS)})")
    chunk = max(1, nbytes // ITEMSIZE // group)
    full = chunk * group  # divisible into one chunk per peer, which gather, scatter and all-to-all need
    if op == "all-gather":
        return chunk, full
    if op == "reduce-scatter":
        return full, chunk
    return full, full


def collective(mesh: Mesh, op: str, axis: str) -> Callable[[jax.Array], jax.Array]:
    """A jitted function running `op` over mesh axis `axis` on a 1-D array sharded over every mesh axis."""
    return _collective(mesh, op, axis)


@cache
def _collective(mesh: Mesh, op: str, axis: str) -> Callable[[jax.Array], jax.Array]:
    # One jit per (mesh, op, axis); jax compiles it once per message size (shape), which is the cache we want.
    n = mesh.shape[axis]
    local = {
        "all-reduce": lambda x: jax.lax.psum(x, axis),
        "all-gather": lambda x: jax.lax.all_gather(x, axis, tiled=True),
        "reduce-scatter": lambda x: jax.lax.psum_scatter(x, axis, tiled=True),
        "all-to-all": lambda x: jax.lax.all_to_all(x.reshape(n, -1), axis, 0, 0, tiled=True).reshape(-1),
        "collective-permute": lambda x: jax.lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)]),
    }[op]
    spec = P(mesh.axis_names)
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=True))


def placed_input(mesh: Mesh, elements: int, values: np.ndarray | None = None) -> jax.Array:
    """A float32 array of `elements` per device, sharded over every mesh axis (block i on the i-th device in
    row-major mesh order); `values` (mesh.size * elements) fills it, else ones."""
    total = mesh.size * elements
    host = np.ones(total, np.float32) if values is None else np.asarray(values, np.float32).reshape(total)
    return jax.device_put(host, NamedSharding(mesh, P(mesh.axis_names)))


def median_seconds(fn: Callable[[], jax.Array], repeats: int, warmup: int = 1) -> float:
    """Median wall time of `fn()` over `repeats` runs, each blocked until ready, after `warmup` untimed runs."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        # One run in flight at a time: two XLA:CPU programs with collectives in flight can deadlock in their rendezvous.
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_collective(mesh: Mesh, op: str, axis: str, nbytes: int, repeats: int) -> Timed:
    """Median time of `op` over `axis` with `nbytes` per device (the size per op: docs/explanation/planner-model.md)."""
    group = mesh.shape[axis]
    inputs, outputs = message_elements(op, nbytes, group)
    fn, x = collective(mesh, op, axis), placed_input(mesh, inputs)
    size = max(inputs, outputs) * ITEMSIZE
    seconds = median_seconds(lambda: fn(x), repeats)
    return Timed(op=op, axis=axis, group=group, bytes=size, seconds=seconds, repeats=repeats)


def matmul_probe(devices: list[jax.Device], repeats: int = 5, size: int | None = None) -> MatmulProbe:
    """Sustained FLOP/s per device of a square matmul: bf16 on one accelerator; fp32 (XLA:CPU's fast path) on every
    CPU device at once, each its own matmul, since simulated devices share the host's cores and a step runs them
    all together (one alone would claim every core)."""
    cpu = devices[0].platform == "cpu"
    used = list(devices) if cpu else [devices[0]]
    size = size or (1024 if cpu else 8192)  # an H100 runs 8192^3 bf16 in ~1.5 ms: dispatch is noise
    dtype = jnp.float32 if cpu else jnp.bfloat16
    mesh = Mesh(np.array(used), ("device",))
    batched = NamedSharding(mesh, P("device"))
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.device_put(jax.random.normal(key_a, (len(used), size, size), dtype), batched)
    b = jax.device_put(jax.random.normal(key_b, (len(used), size, size), dtype), batched)
    matmul = jax.jit(jnp.matmul, out_shardings=batched)  # batch-sharded: each device multiplies its own pair
    seconds = median_seconds(lambda: matmul(a, b), repeats)
    spec = device_spec(devices[0].device_kind)
    return MatmulProbe(device_kind=devices[0].device_kind, dtype=jnp.dtype(dtype).name, size=size, seconds=seconds,
                       flops_per_second=2 * size**3 / seconds, peak=spec.peak_bf16_flops if spec else None,
                       devices=len(used))

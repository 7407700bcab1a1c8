"""The ZeRO floor: the fewest bytes per device per step that data parallelism and ZeRO must move for a run's weights.

Only the parameter traffic of the algorithm (weight gathers, gradient reduce-scatters and all-reduces, the
post-update parameter gather), per parameter and per set of mesh axes, with the bandwidth-optimal costs
`CollectiveOp.bytes_per_execution` uses.

Derivation: docs/describe.md#zero-3-on-large-slices-the-tpu-flags-and-the-zero-floor
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from spmd_train.models.layers import STACKING_AXES
from spmd_train.sharding.arithmetic import spec_axes, ways
from spmd_train.train.engine import Engine


@dataclass(frozen=True)
class FloorTerm:
    """The floor bytes of one kind of collective over one set of mesh axes, per device per step."""

    op: str
    """all-gather, reduce-scatter or all-reduce."""
    axes: tuple[str, ...]
    bytes: float

    def to_json(self) -> dict[str, Any]:
        """The public JSON form: {op, axes, bytes}."""
        return {"op": self.op, "axes": list(self.axes), "bytes": self.bytes}


LOOKUP_ONLY = ("embedding",)
"""Parameters used only by a lookup when embeddings are untied (gathered once per microbatch)."""


def zero_floor(engine: Engine) -> list[FloorTerm]:
    """The ZeRO floor of `engine`'s step, one term per (collective, mesh axes), largest first."""
    cfg, layout, sizes = engine.cfg, engine.layout, dict(engine.mesh.shape)
    compute_bytes = np.dtype(cfg.model.compute_dtype).itemsize
    accum = cfg.train.grad_accum
    batch_axes = {a for name in ("batch", "length") for a in layout.activations.get(name, ())}
    totals: dict[tuple[str, tuple[str, ...]], float] = defaultdict(float)
    flat_logical = dict(jax.tree_util.tree_flatten_with_path(engine.logical, is_leaf=lambda x: isinstance(x, tuple))[0])
    for path, shaped in jax.tree_util.tree_flatten_with_path(engine.param_shapes)[0]:
        names = P(*flat_logical[path])
        numel = math.prod(shaped.shape)
        stored_spec = layout.param_spec(names, None, fsdp=layout.zero_stage >= 3)
        stored = spec_axes(stored_spec)
        # A layer stack split over `pipeline` stays split: each stage computes with its own layers.
        stacking = spec_axes(P(*(e for n, e in zip(names, stored_spec, strict=False) if n in STACKING_AXES)))
        compute = spec_axes(layout.activation_spec(P(*(n for n in names if n not in STACKING_AXES)))) | stacking
        grads = spec_axes(layout.param_spec(names, None, fsdp=layout.zero_stage >= 2))
        optimizer = spec_axes(layout.param_spec(names, None, fsdp=layout.zero_stage >= 1))
        slice_bytes = numel / ways(compute, sizes) * compute_bytes
        key = str(getattr(path[-1], "key", path[-1]))
        gathers = 1 if key in LOOKUP_ONLY and not cfg.model.tie_embeddings else 2
        gathered = _live(stored - compute, sizes)
        if gathered:
            totals["all-gather", gathered] += gathers * accum * slice_bytes * _fraction(gathered, sizes)
        reduced = batch_axes - compute
        scattered = _live(reduced & grads, sizes)
        if scattered:
            totals["reduce-scatter", scattered] += accum * slice_bytes * _fraction(scattered, sizes)
        replicas = _live(reduced - grads, sizes)
        if replicas:
            shard = numel / ways(compute | grads, sizes) * shaped.dtype.itemsize
            totals["all-reduce", replicas] += 2 * shard * _fraction(replicas, sizes)
        regathered = _live(optimizer - stored, sizes)
        if regathered:
            shard = numel / ways(stored, sizes) * shaped.dtype.itemsize
            totals["all-gather", regathered] += shard * _fraction(regathered, sizes)
    terms = [FloorTerm(op, axes, b) for (op, axes), b in totals.items()]
    return sorted(terms, key=lambda t: -t.bytes)


def floor_by_axes(terms: list[FloorTerm]) -> dict[tuple[str, ...], float]:
    """Floor bytes per set of mesh axes, all collectives together."""
    out: dict[tuple[str, ...], float] = defaultdict(float)
    for t in terms:
        out[t.axes] += t.bytes
    return dict(out)


def _live(axes: set[str], sizes: dict[str, int]) -> tuple[str, ...]:
    """The axes of size > 1, in mesh order."""
    return tuple(a for a in sizes if a in axes and sizes[a] > 1)


def _fraction(axes: tuple[str, ...], sizes: dict[str, int]) -> float:
    n = ways(axes, sizes)
    return (n - 1) / n

"""Collectives of a compiled program, attributed to mesh axes and totalled per step."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from jax.sharding import Mesh

from spmd_train.analysis.hlo import CollectiveOp, parse_collectives


@dataclass(frozen=True)
class CollectiveSummary:
    """All executions of one kind of collective over one set of mesh axes in one step."""

    op: str
    axes: tuple[str, ...]
    """Mesh axes the device groups span, in mesh order; ('?',) if the groups could not be read."""
    count: int
    """Executions per step, loop trip counts included."""
    bytes: float
    """Bytes each device sends per step (bandwidth-optimal algorithm)."""
    group_size: int

    def to_json(self) -> dict:
        """The public JSON form: {op, axes, count, bytes} plus the group size."""
        return {"op": self.op, "axes": list(self.axes), "count": self.count, "bytes": self.bytes,
                "group_size": self.group_size}


def group_axes(groups, mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes along which the members of each device group differ."""
    if groups is None:
        return ("?",)
    shape = mesh.devices.shape
    varying: set[int] = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.asarray(group, dtype=np.int64), shape)).T
        varying.update(int(i) for i in np.nonzero((coords != coords[0]).any(axis=0))[0])
    return tuple(mesh.axis_names[i] for i in sorted(varying))


def slice_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes that cross TPU slices (multislice: the axes `mesh.dcn` puts over DCN)."""
    index = np.vectorize(lambda d: getattr(d, "slice_index", 0) or 0)(mesh.devices)
    return tuple(name for i, name in enumerate(mesh.axis_names) if (np.diff(index, axis=i) != 0).any())


def collectives_of(hlo_text: str, mesh: Mesh) -> list[CollectiveSummary]:
    """Per (op, axes): executions and bytes per device for one run of a compiled program."""
    return summarize(parse_collectives(hlo_text, mesh.size), mesh)


def summarize(ops: list[CollectiveOp], mesh: Mesh) -> list[CollectiveSummary]:
    """Total per-op records by (op kind, mesh axes, group size)."""
    totals: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0])
    for op in ops:
        key = (op.kind, slice_axes(mesh) if op.slices else group_axes(op.groups, mesh), op.group_size)
        totals[key][0] += op.executions
        totals[key][1] += op.executions * op.bytes_per_execution
    return [
        CollectiveSummary(op=k[0], axes=k[1], count=int(v[0]), bytes=float(v[1]), group_size=k[2])
        for k, v in sorted(totals.items())
    ]

"""Layout arithmetic, each rule written once: axes of a spec entry, local shapes, rows per device,
the axes an enclosing `shard_map` made manual, and a spec without them."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import jax
from jax.sharding import PartitionSpec as P

from spmd_train.config.resolved_rules import resolve_rules
from spmd_train.config.schema import Config


def entry_axes(spec: P, dim: int) -> tuple[str, ...]:
    """The mesh axes a PartitionSpec puts on one dimension (none past its end)."""
    entry = spec[dim] if dim < len(spec) else None
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec_entry(axes: Sequence[str]) -> str | tuple[str, ...] | None:
    """A PartitionSpec entry putting these mesh axes on one dimension (`entry_axes`' inverse)."""
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def spec_axes(spec: P) -> set[str]:
    """Every mesh axis a PartitionSpec names."""
    return {a for dim in range(len(spec)) for a in entry_axes(spec, dim)}


def ways(axes: Iterable[str], sizes: Mapping[str, int]) -> int:
    """How many pieces these mesh axes split a dimension into."""
    return math.prod(sizes[a] for a in axes)


def local_shape(shape: tuple[int, ...], spec: P, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """Per-device shape of an array of `shape` laid out by `spec` on a mesh with these axis sizes."""
    return tuple(n // ways(entry_axes(spec, dim), sizes) for dim, n in enumerate(shape))


def manual_axes() -> set[str]:
    """The mesh axes an enclosing `shard_map` made manual (none outside any region)."""
    abstract = jax.sharding.get_abstract_mesh()
    return set(abstract.manual_axes) if not abstract.empty else set()


def without_axes(spec: P, axes: set[str]) -> P:
    """The spec with these mesh axes left out (inside a region that made them manual)."""

    def keep(dim):
        kept = tuple(a for a in entry_axes(spec, dim) if a not in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return P(*(keep(dim) for dim in range(len(spec))))


def rows_per_device(cfg: Config, sizes: Mapping[str, int]) -> int:
    """Rows of the global batch each device holds per accumulation step (split over the `batch` rule's axes)."""
    return cfg.train.global_batch_size // (cfg.train.grad_accum * ways(resolve_rules(cfg).batch_axes, sizes))

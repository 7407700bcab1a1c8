"""The parameter table of `describe`: each parameter's shape, sharding and bytes per device."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import NamedSharding

from spmd_train.train.engine import Engine


@dataclass(frozen=True)
class ParamRow:
    """One parameter: where it lives and what it costs each device."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    logical: tuple[str | None, ...]
    spec: tuple[Any, ...]
    bytes_per_device: int


def param_rows(engine: Engine, params: Any) -> list[ParamRow]:
    """One row per parameter of `params` (abstract arrays with their shardings), in tree order."""
    rows = []
    flat_logical = dict(jax.tree_util.tree_flatten_with_path(engine.logical, is_leaf=lambda x: isinstance(x, tuple))[0])
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        logical = flat_logical[path]
        rows.append(ParamRow(
            path=".".join(str(getattr(k, "key", k)) for k in path),
            shape=tuple(leaf.shape),
            dtype=str(leaf.dtype),
            logical=tuple(logical),
            spec=tuple(leaf.sharding.spec) + (None,) * (len(leaf.shape) - len(leaf.sharding.spec)),
            bytes_per_device=_shard_bytes(leaf),
        ))
    return rows


def _shard_bytes(leaf: jax.ShapeDtypeStruct) -> int:
    shape = leaf.sharding.shard_shape(leaf.shape) if isinstance(leaf.sharding, NamedSharding) else leaf.shape
    return math.prod(shape) * leaf.dtype.itemsize


def bytes_per_device(tree: Any) -> int:
    """Bytes each device holds of the (abstract, sharded) arrays of `tree`."""
    return sum(_shard_bytes(x) for x in jax.tree.leaves(tree))

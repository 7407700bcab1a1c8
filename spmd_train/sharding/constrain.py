"""`constrain(x, names)`: the one call model code makes to state an activation's layout.

The active Layout is set from outside the model (by the train step) with `use_layout`;
without one, `constrain` is the identity, so the same model runs unsharded.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd_train.sharding.rules import Layout

_ACTIVE: contextvars.ContextVar[Layout | None] = contextvars.ContextVar("spmd_train_layout", default=None)


@contextlib.contextmanager
def use_layout(layout: Layout | None) -> Iterator[None]:
    """Make `layout` the one `constrain` applies while tracing inside this block."""
    token = _ACTIVE.set(layout)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_layout() -> Layout | None:
    """The layout set by the innermost `use_layout`, if any."""
    return _ACTIVE.get()


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrain an activation to the mesh axes its logical axis names map to."""
    layout = _ACTIVE.get()
    if layout is None:
        return x
    spec = layout.activation_spec(P(*names))
    abstract = jax.sharding.get_abstract_mesh()
    manual = set(abstract.manual_axes) if not abstract.empty else set()
    if not manual:
        return jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, spec))
    # Inside a shard_map region the manual axes are already split by hand; constrain the rest.
    return jax.lax.with_sharding_constraint(x, P(*(_without(entry, manual) for entry in spec)))


def _without(entry, manual: set[str]):
    if entry is None:
        return None
    axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry) if a not in manual)
    return None if not axes else axes[0] if len(axes) == 1 else axes

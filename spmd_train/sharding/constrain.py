"""`constrain(x, names)`: the one call model code makes to state an activation's layout.

The active Layout is set from outside the model (by the train step) with `use_layout`;
without one, `constrain` is the identity, so the same model runs unsharded.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd_train.sharding.arithmetic import manual_axes, without_axes
from spmd_train.sharding.layout import Layout

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
    return _apply(x, layout, layout.activation_spec(P(*names)))


def constrain_to_spec(x: jax.Array, spec: P) -> jax.Array:
    """Constrain an array to a mesh PartitionSpec under the active layout (for code that derives its own layout from
    the layout's rules, as `sharding.whole_matrices` does); the identity without one."""
    layout = _ACTIVE.get()
    return x if layout is None else _apply(x, layout, spec)


def stored_param(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pin a parameter to its stored layout, and its gradient to the gradient layout.

    Placed where a weight enters the computation, this makes each layer's weight gradient
    leave the backward pass already reduced into its shard (a reduce-scatter inside the
    layer loop at ZeRO >= 2) instead of as a full all-reduced tensor sliced afterwards.
    Inside a shard_map the manual axes are left out of both layouts.
    """
    layout = _ACTIVE.get()
    if layout is None:
        return x
    return _stored(x, tuple(names), layout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _stored(x, names, layout):
    return _apply(x, layout, layout.param_spec(P(*names), None, fsdp=layout.zero_stage >= 3))


def _stored_fwd(x, names, layout):
    return _stored(x, names, layout), None


def _stored_bwd(names, layout, _, ct):
    for spec in layout.scatter_path(P(*names), ct.shape, manual_axes()):
        ct = _apply(ct, layout, spec)
    return (_apply(ct, layout, layout.param_spec(P(*names), None, fsdp=layout.zero_stage >= 2)),)


_stored.defvjp(_stored_fwd, _stored_bwd)


def _apply(x: jax.Array, layout: Layout, spec: P) -> jax.Array:
    manual = manual_axes()
    if not manual:
        return jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, spec))
    # Inside a shard_map region the manual axes are already split by hand; constrain the rest.
    return jax.lax.with_sharding_constraint(x, without_axes(spec, manual))

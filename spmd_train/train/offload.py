"""offload.optimizer: the optimizer state in pinned host memory, streamed through the device a slice at a time.

The state's parameter-shaped arrays (the moments, and precision.master's float32 copy) are stored with
`memory_kind="pinned_host"` shardings. Each step cuts every parameter, gradient and state array into `groups` slices
along a dimension no mesh axis splits (the layer stack's layers, a table's rows: a slice is a local cut, no data moves
between devices), and for each slice brings its state to the device, runs the optimizer on it, keeps or drops the
result as the step guards decided, and sends it back. XLA overlaps one slice's transfers with another's update, and
the device holds a few slices of the state at a time instead of all of it (the ZeRO-Offload idea, Ren et al. 2021,
with the update kept on the device).

Exact: the optimizers allowed (`config.optimizer_facts.OptimizerFacts.elementwise`) update each element from its own
gradient, state and value, so a slice's update is the whole update's slice; gradient clipping, the one step that reads
every gradient, takes the whole gradient's norm first and scales each slice as the optimizer's chain would (`clipper`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from spmd_train.config.offload_schema import HOST_MEMORY_KIND
from spmd_train.config.schema import Config
from spmd_train.errors import ConfigError
from spmd_train.sharding.arithmetic import entry_axes
from spmd_train.train.master_weights import to_f32

MAX_GROUPS = 64
"""The most slices `offload.optimizer_groups=null` picks (each is an unrolled copy of the optimizer's update)."""


@dataclass(frozen=True)
class Cut:
    """How one parameter-shaped array is sliced: along `axis` at `bounds` (groups + 1 offsets), or, when no
    dimension is free of mesh axes, whole in group `whole` and empty in the others."""

    axis: int
    bounds: tuple[int, ...]
    whole: int | None = None

    def take(self, x: jax.Array, group: int) -> jax.Array:
        """Slice `group` of `x` (possibly empty)."""
        if self.whole is not None:
            return x if group == self.whole else jax.lax.slice_in_dim(x, 0, 0, axis=0)
        return jax.lax.slice_in_dim(x, self.bounds[group], self.bounds[group + 1], axis=self.axis)

    def put(self, x: jax.Array, piece: jax.Array, group: int) -> jax.Array:
        """`x` with slice `group` replaced by `piece` (an in-place update XLA can do in `x`'s own buffer)."""
        if self.whole is not None:
            return piece if group == self.whole else x
        return jax.lax.dynamic_update_slice_in_dim(x, piece, self.bounds[group], axis=self.axis)


class _NotAParameter:
    """The role of a state leaf that mirrors no parameter (step counts, the loss scale): passed whole to every slice."""


NOT_A_PARAMETER = _NotAParameter()


@dataclass(frozen=True)
class OffloadPlan:
    """Where the optimizer state lives and how it streams (`Engine.offload`)."""

    groups: int
    cuts: Any
    """A `Cut` per parameter (the parameter tree's structure)."""
    device: Any
    """The state's shardings on the device (what the update computes in)."""
    stored: Any
    """The state's shardings as stored between steps: pinned host memory for the offloaded arrays."""
    host_bytes_per_device: int
    """Bytes of optimizer state each device's host keeps."""


def default_groups(cfg: Config, stored_rows: int) -> int:
    """offload.optimizer_groups, or one slice per stored row of the layer stack (at most MAX_GROUPS)."""
    return cfg.offload.optimizer_groups or max(1, min(stored_rows, MAX_GROUPS))


def check_host_memory(cfg: Config, device: jax.Device) -> None:
    """Refuse offloading on devices without pinned host memory, naming the memories they have."""
    if not cfg.offload.optimizer_share:
        return
    kinds = sorted({m.kind for m in device.addressable_memories()})
    if HOST_MEMORY_KIND not in kinds:
        raise ConfigError(f"offload.optimizer={str(cfg.offload.optimizer).lower()} keeps the optimizer state in "
                          f"{HOST_MEMORY_KIND} memory, which {device.platform} devices ({device.device_kind}) do not "
                          f"offer (their memories: {', '.join(kinds)}; valid: offload.optimizer=false)")


def plan_offload(cfg: Config, tx: optax.GradientTransformation, opt_shapes: Any, opt_sh: Any, param_shapes: Any,
                 param_opt_sh: Any, stored_rows: int) -> OffloadPlan:
    """The offload plan for a state of `opt_shapes` laid out as `opt_sh` (parameters `param_shapes`, their optimizer
    layout `param_opt_sh`): which arrays go to the host (offload.optimizer's share of the bytes, the layer stack's
    first) and how each is sliced."""
    groups = default_groups(cfg, stored_rows)
    paths_shapes = jax.tree_util.tree_flatten_with_path(param_shapes)[0]
    shardings = jax.tree.leaves(param_opt_sh)
    cuts = [_cut(s.shape, sh, groups, i) for i, ((_, s), sh) in enumerate(zip(paths_shapes, shardings, strict=True))]
    # Which parameters' state goes to the host: the layer stack's first, in order, until the share is reached.
    sizes = [math.prod(s.shape) for _, s in paths_shapes]
    order = sorted(range(len(sizes)), key=lambda i: (not _in_stack(paths_shapes[i][0]), i))
    target, taken, host = cfg.offload.optimizer_share * sum(sizes), 0, set()
    for i in order:
        if taken >= target * (1 - 1e-9):
            break
        host.add(i)
        taken += sizes[i]
    treedef = jax.tree.structure(param_shapes)
    offloaded = jax.tree.unflatten(treedef, [i in host for i in range(len(sizes))])
    stored = optax.tree_map_params(tx, lambda sh, off: sh.with_memory_kind(HOST_MEMORY_KIND) if off else sh,
                                   opt_sh, offloaded, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
    host_bytes = sum(_bytes(s, sh) for s, sh in zip(jax.tree.leaves(opt_shapes), jax.tree.leaves(stored), strict=True)
                     if sh.memory_kind == HOST_MEMORY_KIND)
    return OffloadPlan(groups, jax.tree.unflatten(treedef, cuts), opt_sh, stored, host_bytes)


def clipper(grads: Any, cfg: Config) -> Callable[[Any], Any]:
    """What the optimizer's chain does to the gradients before its core (`train.optimizer.make_optimizer`), as a
    function of a slice of them: float32 under a master copy, then scaled to optim.clip_norm if the whole gradient's
    global norm exceeds it. The same operations on each element as the chain's, so a streamed update equals the whole
    one bit for bit; applied a slice at a time, no clipped copy of the whole gradient is made."""
    cast = to_f32 if cfg.precision.master == "float32" else (lambda tree: tree)
    max_norm = cfg.optim.clip_norm
    if max_norm is None:
        return cast
    g_norm = optax.tree.norm(cast(grads))
    trigger = jnp.squeeze(g_norm < max_norm)  # optax.clip_by_global_norm's rule, element for element

    def clip(tree: Any) -> Any:
        return jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm), cast(tree))

    return clip


def streamed_update(tx: optax.GradientTransformation, plan: OffloadPlan, grads: Any, state: Any, params: Any,
                    keep: jax.Array, apply: Callable[[Any, Any], Any], clip: Callable[[Any], Any]) -> tuple[Any, Any]:
    """(new parameters, new state) of `tx` (whose chain clips nothing), slice by slice, each slice's gradient
    prepared by `clip` (`clipper`): `apply(params, updates)` makes a slice's new parameters, which, like its new
    state, are kept
    where `keep` holds, else the old ones. Each result is written back into its array in place (the state into
    its home memory), so neither the whole update nor a second copy of the parameters or the state is ever made."""
    state_leaves, state_def = jax.tree.flatten(state)
    roles = jax.tree.leaves(
        optax.tree_map_params(tx, lambda _, cut: cut, state, plan.cuts, transform_non_params=lambda _: NOT_A_PARAMETER,
                              is_leaf=lambda x: isinstance(x, optax.MaskedNode)),
        is_leaf=lambda x: isinstance(x, (Cut, _NotAParameter)))
    device, stored = jax.tree.leaves(plan.device), jax.tree.leaves(plan.stored)
    cuts, param_def = jax.tree.flatten(plan.cuts, is_leaf=lambda x: isinstance(x, Cut))
    grad_leaves = jax.tree.leaves(grads)
    param_leaves = list(jax.tree.leaves(params))
    out_state = list(state_leaves)
    # after[k]: the stored state once slices 0..k-1 are written back. Slice g is read from after[g - 1] (its own
    # values: no slice writes another's): the data dependence keeps XLA from fetching it before slice g - 2 is
    # home, so the device holds about two slices (one updating, the next arriving) however much memory it has.
    done: list[Any] = []  # each slice's new state, on the device
    scalars = None
    for g in range(plan.groups):
        with jax.named_scope(f"offload_group_{g}"):
            source = out_state
            if g >= 2:
                source, _ = jax.lax.optimization_barrier((out_state, done[g - 2]))
            old = [jax.device_put(role.take(x, g), sh) if isinstance(role, Cut) else x
                   for x, role, sh in zip(source, roles, device, strict=True)]
            old_params = [c.take(x, g) for x, c in zip(param_leaves, cuts, strict=True)]
            grads_g = clip(param_def.unflatten([c.take(x, g) for x, c in zip(grad_leaves, cuts, strict=True)]))
            updates, new = tx.update(grads_g, state_def.unflatten(old), param_def.unflatten(old_params))
            new_params = jax.tree.leaves(apply(param_def.unflatten(old_params), updates))
            for i, (c, n, o) in enumerate(zip(cuts, new_params, old_params, strict=True)):
                param_leaves[i] = c.put(param_leaves[i], jnp.where(keep, n, o), g)
            new = [jnp.where(keep, n, o) for n, o in zip(jax.tree.leaves(new), old, strict=True)]
            for i, (n, role, sh) in enumerate(zip(new, roles, stored, strict=True)):
                if isinstance(role, Cut):
                    out_state[i] = role.put(out_state[i], jax.device_put(n, sh), g)
            done.append(new)
            if scalars is None:  # step counts and the like: the same in every slice
                scalars = {i: n for i, (n, role) in enumerate(zip(new, roles, strict=True))
                           if not isinstance(role, Cut)}
    for i, n in (scalars or {}).items():
        out_state[i] = n
    return param_def.unflatten(param_leaves), state_def.unflatten(out_state)


def to_device(state: Any, plan: OffloadPlan) -> Any:
    """The whole state on the device (for computations over all of it at once: health checks, re-layouts)."""
    return jax.device_put(state, plan.device)


def _cut(shape: tuple[int, ...], sharding: NamedSharding, groups: int, index: int) -> Cut:
    # Not the minor dimension: TPUs write host memory in whole (8, 128) tiles ("lane slice updating is not supported"),
    # and a slice of rows is one contiguous block anyway.
    free = [d for d in range(len(shape) - 1) if not entry_axes(sharding.spec, d) and shape[d] >= 2]
    if not free:
        return Cut(0, (), whole=index % groups)
    axis = max(free, key=lambda d: (shape[d] >= groups, -d))  # the first that gives every group a slice
    bounds = np.linspace(0, shape[axis], groups + 1).round().astype(int)
    return Cut(axis, tuple(int(b) for b in bounds))


def _bytes(shape: Any, sharding: NamedSharding) -> int:
    local = sharding.shard_shape(shape.shape)
    return math.prod(local) * jnp.dtype(shape.dtype).itemsize


def _in_stack(path) -> bool:
    return any(getattr(k, "key", None) == "blocks" for k in path)

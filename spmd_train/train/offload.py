"""offload.optimizer: the optimizer state in pinned host memory, streamed through the device a slice at a time.

The state's parameter-shaped arrays (the moments, and precision.master's float32 copy) are stored with
`memory_kind="pinned_host"` shardings. Each step cuts every parameter, gradient and state array into `groups` equal
slices along a dimension no mesh axis splits (the layer stack's layers, a table's rows: a slice is a local cut, no
data moves between devices) and, in a loop over the groups, brings one slice of the state to the device, runs the
optimizer on it, keeps or drops the result as the step guards decided, and writes it back in place. In a loop XLA
fetches at most one slice ahead, so the device holds about two slices of the state instead of all of it (the
ZeRO-Offload idea, Ren et al. 2021, with the update kept on the device). Arrays with no such dimension are updated
whole beside the loop.

offload.params keeps the layer stack's parameters on the host as well (the layer loop fetches each layer,
`models.transformer.fetched`) and, since autodiff makes a host-resident input's gradient in host memory, their
gradients: the global norm (`streamed_norm`) and the update read both a slice at a time like the state.

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
import optax
from jax.sharding import NamedSharding

from spmd_train.config.mesh_schema import OFFLOADS_ACTIVATIONS, offloads_activations
from spmd_train.config.offload_schema import HOST_MEMORY_KIND, optimizer_groups
from spmd_train.config.schema import Config
from spmd_train.errors import ConfigError
from spmd_train.models.layers import in_host_memory
from spmd_train.models.param_specs import in_layer_stack
from spmd_train.sharding.arithmetic import entry_axes
from spmd_train.train.guards import keep_if
from spmd_train.train.master_weights import to_f32
from spmd_train.train.memory_fit import bytes_per_device


@dataclass(frozen=True)
class Cut:
    """How one parameter-shaped array streams: `groups` equal slices of `size` along `axis` (`streamed`), or, when no
    dimension free of mesh axes divides into them, all of it at once beside the loop (`axis` None: resident)."""

    axis: int | None
    size: int = 0

    @property
    def streamed(self) -> bool:
        """Whether the array goes through the device a slice at a time."""
        return self.axis is not None

    def take(self, x: jax.Array, group: jax.Array) -> jax.Array:
        """Slice `group` of a streamed array."""
        return jax.lax.dynamic_slice_in_dim(x, group * self.size, self.size, axis=self.axis)

    def put(self, x: jax.Array, piece: jax.Array, group: jax.Array) -> jax.Array:
        """`x` with slice `group` replaced by `piece`, in place."""
        return jax.lax.dynamic_update_slice_in_dim(x, piece, group * self.size, axis=self.axis)


def _empty(x: jax.Array) -> jax.Array:
    """`x` with no rows: its place in an update that leaves it out (an elementwise update of nothing is free)."""
    return jax.lax.slice_in_dim(x, 0, 0, axis=0)


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
    params_device: Any = None
    """The parameters' shardings on the device (what the update computes in)."""
    params_stored: Any = None
    """The parameters' shardings as stored: pinned host memory for the layer stack under offload.params."""
    host_param_bytes_per_device: int = 0
    """Bytes of parameters each device's host keeps (offload.params)."""
    grads_device: Any = None
    """The gradients' shardings on the device: where a slice of an offloaded parameter's gradient, which autodiff
    makes in host memory, is brought for the update."""


def params_on_host(param_sh: Any) -> Any:
    """The parameters' shardings with the layer stack's in pinned host memory (offload.params)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, sh: sh.with_memory_kind(HOST_MEMORY_KIND) if in_layer_stack(path) else sh, param_sh)


def check_host_memory(cfg: Config, device: jax.Device) -> None:
    """Refuse offloading (the optimizer state, or activations through parallel.remat) on devices without pinned host
    memory, naming the memories they have."""
    asks = []
    if cfg.offload.optimizer_share:
        asks.append((f"offload.optimizer={str(cfg.offload.optimizer).lower()} keeps the optimizer state",
                     "offload.optimizer=false"))
    par = cfg.parallel
    if par.remat in OFFLOADS_ACTIVATIONS:
        asks.append((f"parallel.remat={par.remat} keeps each layer's input", "parallel.remat=full"))
    elif offloads_activations(par.remat, par.remat_offload):
        asks.append((f"parallel.remat_offload=[{', '.join(par.remat_offload)}] keeps those intermediates",
                     "parallel.remat_offload=[]"))
    kinds = sorted({m.kind for m in device.addressable_memories()})
    if asks and HOST_MEMORY_KIND not in kinds:
        what, valid = asks[0]
        raise ConfigError(f"{what} in {HOST_MEMORY_KIND} memory, which {device.platform} devices "
                          f"({device.device_kind}) do not offer (their memories: {', '.join(kinds)}; valid: {valid})")


def plan_offload(cfg: Config, tx: optax.GradientTransformation, opt_shapes: Any, opt_sh: Any, param_shapes: Any,
                 param_opt_sh: Any, stored_rows: int, param_sh: Any, grad_sh: Any) -> OffloadPlan:
    """The offload plan for a state of `opt_shapes` laid out as `opt_sh` (parameters `param_shapes` stored as
    `param_sh`, their optimizer layout `param_opt_sh`): which arrays go to the host (offload.optimizer's share of the
    bytes, the layer stack's first) and how each is sliced."""
    groups = optimizer_groups(cfg.offload.optimizer_groups, stored_rows)
    paths_shapes = jax.tree_util.tree_flatten_with_path(param_shapes)[0]
    shardings = jax.tree.leaves(param_opt_sh)
    cuts = [_cut(s.shape, sh, groups) for (_, s), sh in zip(paths_shapes, shardings, strict=True)]
    # Which parameters' state goes to the host: the layer stack's first, in order, until the share is reached.
    sizes = [math.prod(s.shape) for _, s in paths_shapes]
    order = sorted(range(len(sizes)), key=lambda i: (not in_layer_stack(paths_shapes[i][0]), i))
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
    on_host = [(s, sh) for s, sh in zip(jax.tree.leaves(opt_shapes), jax.tree.leaves(stored), strict=True)
               if sh.memory_kind == HOST_MEMORY_KIND]
    host_bytes = bytes_per_device([s for s, _ in on_host], [sh for _, sh in on_host])
    params_host = [(s, sh) for s, sh in zip(jax.tree.leaves(param_shapes), jax.tree.leaves(param_sh), strict=True)
                   if sh.memory_kind == HOST_MEMORY_KIND]
    param_bytes = bytes_per_device([s for s, _ in params_host], [sh for _, sh in params_host])
    params_device = jax.tree.map(lambda sh: sh.with_memory_kind("device"), param_sh)
    return OffloadPlan(groups, jax.tree.unflatten(treedef, cuts), opt_sh, stored, host_bytes, params_device, param_sh,
                       param_bytes, grad_sh)


def _cast(cfg: Config) -> Callable[[Any], Any]:
    """What the optimizer's chain does to the gradients first: float32 under a master copy."""
    return to_f32 if cfg.precision.master == "float32" else (lambda tree: tree)


def grads_on_host(plan: OffloadPlan | None) -> bool:
    """Whether autodiff makes some gradients in host memory (those of offload.params's host-resident parameters)."""
    return plan is not None and plan.host_param_bytes_per_device > 0


def streamed_norm(grads: Any, plan: OffloadPlan, cfg: Config) -> jax.Array:
    """The global norm of the gradients as the optimizer's chain reads them (`_cast`), those in host memory read a
    slice at a time through the device (no whole copy of them there)."""
    cast = _cast(cfg)
    cuts = jax.tree.leaves(plan.cuts, is_leaf=lambda x: isinstance(x, Cut))
    total = jnp.zeros((), jnp.float32)
    square = lambda x: jnp.sum(jnp.square(cast(x).astype(jnp.float32)))
    for g, c, sh in zip(jax.tree.leaves(grads), cuts, jax.tree.leaves(plan.grads_device), strict=True):
        if not in_host_memory(g):
            total += square(g)
        elif not c.streamed:
            total += square(jax.device_put(g, sh))
        else:
            total += jax.lax.fori_loop(0, plan.groups, lambda i, acc, g=g, c=c, sh=sh:
                                       acc + square(jax.device_put(c.take(g, i), sh)), jnp.zeros((), jnp.float32))
    return jnp.sqrt(total)


def clipper(grads: Any, cfg: Config, g_norm: jax.Array | None = None) -> Callable[[Any], Any]:
    """What the optimizer's chain does to the gradients before its core (`train.optimizer.make_optimizer`), as a
    function of a slice of them: float32 under a master copy, then scaled to optim.clip_norm if the whole gradient's
    global norm (`g_norm`, or computed here) exceeds it. The same operations on each element as the chain's, so a
    streamed update equals the whole one bit for bit given the same norm; applied a slice at a time, no clipped copy
    of the whole gradient is made."""
    cast = _cast(cfg)
    max_norm = cfg.optim.clip_norm
    if max_norm is None:
        return cast
    if g_norm is None:
        g_norm = optax.tree.norm(cast(grads))
    trigger = jnp.squeeze(g_norm < max_norm)  # optax.clip_by_global_norm's rule, element for element

    def clip(tree: Any) -> Any:
        return jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm), cast(tree))

    return clip


def streamed_update(tx: optax.GradientTransformation, plan: OffloadPlan, grads: Any, state: Any, params: Any,
                    keep: jax.Array, apply: Callable[[Any, Any], Any], clip: Callable[[Any], Any]) -> tuple[Any, Any]:
    """(new parameters, new state) of `tx` (whose chain clips nothing): the resident arrays at once, then the
    streamed ones in a loop over the groups, each slice's gradient prepared by `clip` (`clipper`) and its new
    parameters made by `apply(params, updates)`. New parameters and state are kept where `keep` holds, else the old
    ones, and written back in place (the state into its home memory). In a loop XLA fetches a slice at most one
    iteration ahead, so the device holds about two slices of the state at a time."""
    state_leaves, state_def = jax.tree.flatten(state)
    roles = jax.tree.leaves(
        optax.tree_map_params(tx, lambda _, cut: cut, state, plan.cuts, transform_non_params=lambda _: NOT_A_PARAMETER,
                              is_leaf=lambda x: isinstance(x, optax.MaskedNode)),
        is_leaf=lambda x: isinstance(x, (Cut, _NotAParameter)))
    device, stored = jax.tree.leaves(plan.device), jax.tree.leaves(plan.stored)
    cuts, param_def = jax.tree.flatten(plan.cuts, is_leaf=lambda x: isinstance(x, Cut))
    grad_leaves, param_leaves = jax.tree.leaves(grads), jax.tree.leaves(params)
    # offload.params: the layer stack's parameters come to the device and go back like the state.
    p_device, p_stored = jax.tree.leaves(plan.params_device), jax.tree.leaves(plan.params_stored)
    p_host = [sh.memory_kind == HOST_MEMORY_KIND for sh in p_stored]
    to_dev = lambda leaves: [jax.device_put(x, sh) if h else x for x, sh, h in zip(leaves, p_device, p_host,
                                                                                    strict=True)]
    to_home = lambda leaves: [jax.device_put(x, sh) if h else x for x, sh, h in zip(leaves, p_stored, p_host,
                                                                                     strict=True)]
    # Their gradients, made in host memory by autodiff, come to the device a slice at a time too.
    g_device = jax.tree.leaves(plan.grads_device) if plan.grads_device is not None else [None] * len(p_host)
    g_to_dev = lambda leaves: [jax.device_put(x, sh) if in_host_memory(x) else x
                               for x, sh in zip(leaves, g_device, strict=True)]

    def update(g_leaves, p_leaves, s_leaves):
        """One update of the whole tree's structure: (new parameter leaves, new state leaves), kept or not."""
        updates, new = tx.update(clip(param_def.unflatten(g_leaves)), state_def.unflatten(s_leaves),
                                 param_def.unflatten(p_leaves))
        new_params = jax.tree.leaves(apply(param_def.unflatten(p_leaves), updates))
        return keep_if(keep, new_params, p_leaves), keep_if(keep, jax.tree.leaves(new), s_leaves)

    # The resident arrays whole (the streamed ones empty); this call also gives the step counts their new values.
    pick = lambda leaves, cut_of: [_empty(x) if c.streamed else x for x, c in zip(leaves, cut_of, strict=True)]
    state_cuts = [r if isinstance(r, Cut) else None for r in roles]
    s_in = [x if r is None else jax.device_put(_empty(x) if r.streamed else x, sh)
            for x, r, sh in zip(state_leaves, state_cuts, device, strict=True)]
    new_p, new_s = update(g_to_dev(pick(grad_leaves, cuts)), to_dev(pick(param_leaves, cuts)), s_in)
    out_params = [x if c.streamed else n for x, n, c in zip(param_leaves, to_home(new_p), cuts, strict=True)]
    out_state = [n if r is None else x if r.streamed else jax.device_put(n, sh)
                 for x, n, r, sh in zip(state_leaves, new_s, state_cuts, stored, strict=True)]

    # The loop carries every array (the step counts and resident ones pass through unchanged: the first call's);
    # each slice's update reads the step counts as the step began.
    state_leaves_in_loop = lambda s_all: [old if r is None else x for x, old, r in
                                          zip(s_all, state_leaves, state_cuts, strict=True)]

    def body(group, carry):
        p_all, s_all = carry
        slice_or_empty = lambda x, c: c.take(x, group) if c.streamed else _empty(x)
        s_in = [x if r is None else jax.device_put(slice_or_empty(x, r), sh)
                for x, r, sh in zip(state_leaves_in_loop(s_all), state_cuts, device, strict=True)]
        new_p, new_s = update(g_to_dev([slice_or_empty(x, c) for x, c in zip(grad_leaves, cuts, strict=True)]),
                              to_dev([slice_or_empty(x, c) for x, c in zip(p_all, cuts, strict=True)]), s_in)
        p_all = [c.put(x, n, group) if c.streamed else x for x, n, c in zip(p_all, to_home(new_p), cuts, strict=True)]
        s_all = [r.put(x, jax.device_put(n, sh), group) if r is not None and r.streamed else x
                 for x, n, r, sh in zip(s_all, new_s, state_cuts, stored, strict=True)]
        return p_all, s_all

    with jax.named_scope("offload_stream"):
        out_params, out_state = jax.lax.fori_loop(0, plan.groups, body, (out_params, out_state))
    return param_def.unflatten(out_params), state_def.unflatten(out_state)


def to_device(state: Any, plan: OffloadPlan) -> Any:
    """The whole state on the device (for computations over all of it at once: health checks, re-layouts)."""
    return jax.device_put(state, plan.device)


def params_to_device(params: Any, plan: OffloadPlan | None) -> Any:
    """The parameters on the device (offload.params keeps the layer stack's on the host): for whole-tree work."""
    return params if plan is None or not plan.host_param_bytes_per_device else jax.device_put(params,
                                                                                               plan.params_device)


def _cut(shape: tuple[int, ...], sharding: NamedSharding, groups: int) -> Cut:
    # Not the minor dimension: TPUs write host memory in whole (8, 128) tiles ("lane slice updating is not supported"),
    # and a slice of rows is one contiguous block anyway.
    free = [d for d in range(len(shape) - 1) if not entry_axes(sharding.spec, d) and shape[d] % groups == 0]
    return Cut(free[0], shape[free[0]] // groups) if free and groups > 1 else Cut(None)

"""Attention by implementation name, with kernels run per device inside `shard_map`.

Mosaic kernels cannot be partitioned by the compiler, so under an active layout the Pallas
(and cuDNN) paths are wrapped in a `shard_map` over the mesh axes that split batch and heads;
the activations' logical rules say which those are. With `sequence` > 1 the same region runs
the context-parallel schemes of `parallel.context` on each device's chunk of the sequence.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from spmd_train.ops.attention import FULL, Scoring, with_sinks
from spmd_train.parallel.attention_backends import attention_backend
from spmd_train.parallel.attention_registry import Kernel
from spmd_train.parallel.backends import Backends
from spmd_train.parallel.context import AXIS, context_attention
from spmd_train.sharding.arithmetic import entry_axes, manual_axes, without_axes
from spmd_train.sharding.constrain import active_layout


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, backends: Backends, segments: jax.Array | None = None,
              scoring: Scoring = FULL, sinks: jax.Array | None = None) -> jax.Array:
    """Causal grouped-query attention, q [b, l, h, d], k [b, l, kvh, d] and v [b, l, kvh, dv] -> [b, l, h, dv].

    `backends` (resolved when the engine was built) says which implementation runs and how, and
    with `sequence` > 1 which context-parallel scheme joins the devices' chunks of the sequence.
    `segments` [b, l]: each token's document; a query sees only keys of its own document.
    `scoring`: the layer's scale, soft-cap and window. `sinks` [h]: each head's sink logit, applied to the
    attention over the keys through its log-sum-exp (`ops.attention.with_sinks`), outside any kernel."""
    layout = active_layout()
    backend = attention_backend(backends.attention)
    dv = v.shape[-1]
    if dv != q.shape[-1] and not (backend.partitioned and backends.context is None):
        # MLA: values of another width than queries and keys. Kernels and context-parallel schemes take one width;
        # zero value columns add zero outputs, zero q/k columns zero scores (the scale fixed first): exact.
        out = attention(*_widened(q, k, v), backends=backends, segments=segments, sinks=sinks,
                        scoring=dataclasses.replace(scoring, scale=_scale(scoring, q.shape[-1])))
        return out[..., :dv]
    local = backend.kernel(backends)
    lse = sinks is not None
    if backends.context is not None and layout is not None:
        def kernel(*args):
            q, k, v, *seg = args
            return context_attention(q, k, v, seg[0] if seg else None, how=backends.context,
                                     ways=backends.sequence, kernel=local, scoring=scoring, return_lse=lse)
        result = _per_device(kernel, q, k, v, segments, layout, length=(AXIS,), lse=lse)
    elif backend.partitioned:  # XLA splits it as the activations' rules say: no region needed
        result = local(q, k, v, segments, True, lse, scoring)
    else:
        kernel = lambda q, k, v, seg=None: local(q, k, v, seg, True, lse, scoring)
        if layout is None:
            result = kernel(q, k, v) if segments is None else kernel(q, k, v, segments)
        else:
            result = _per_device(kernel, q, k, v, segments, layout, length=(), lse=lse)
    return with_sinks(*result, sinks) if lse else result


def _scale(scoring: Scoring, width: int) -> float:
    return scoring.scale if scoring.scale is not None else width**-0.5


def _widened(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k, v zero-padded on their last axis to the widest of them."""
    width = max(q.shape[-1], v.shape[-1])
    return tuple(jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])]) for x in (q, k, v))


def local_kernel(backends: Backends) -> Kernel:
    """kernel(q, k, v, segments, causal, return_lse) for one device's arrays: the registered implementation's."""
    return attention_backend(backends.attention).kernel(backends)


def _per_device(kernel, q, k, v, segments, layout, *, length: tuple[str, ...], lse: bool = False):
    """Run `kernel` on each device's q, k, v (and segments) in a region manual over every mesh axis.

    `length`: the mesh axes the activations' `length` must be split over (the region's kernel
    assumes exactly those chunks). `lse`: the kernel also returns the log-sum-exp [b, h, l]."""
    args = (q, k, v) if segments is None else (q, k, v, segments)
    manual = manual_axes()
    q_spec = layout.activation_spec(P("batch", "length", "heads", "head_dim"))
    if entry_axes(q_spec, 1) != length:  # axes of size 1 are never in a spec
        raise ValueError(f"attention expects the activations' length on {list(length)}, the rules put it on "
                         f"{list(entry_axes(q_spec, 1))}")
    q_spec = without_axes(q_spec, manual)
    kv_spec = without_axes(layout.activation_spec(P("batch", "length", "kv_heads", "head_dim")), manual)
    mesh = jax.sharding.get_abstract_mesh() if manual else layout.mesh
    # Mosaic kernels need every mesh axis manual, not only those that split batch and heads;
    # along the others each device simply holds (and computes) the whole thing.
    axes = set(mesh.axis_names) - manual
    if not axes:
        return kernel(*args)
    specs = (q_spec, kv_spec, kv_spec) + (() if segments is None else (P(*q_spec[:2]),))
    entries = (*q_spec, *(None,) * (4 - len(q_spec)))
    out_specs = (q_spec, P(entries[0], entries[2], entries[1])) if lse else q_spec
    return jax.shard_map(kernel, mesh=mesh, in_specs=specs, out_specs=out_specs, axis_names=axes,
                         check_vma=False)(*args)

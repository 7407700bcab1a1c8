"""Attention by implementation name, with kernels run per device inside `shard_map`.

Mosaic kernels cannot be partitioned by the compiler, so under an active layout the Pallas
(and cuDNN) paths are wrapped in a `shard_map` over the mesh axes that split batch and heads;
the activations' logical rules say which those are. With `sequence` > 1 the same region runs
the context-parallel schemes of `parallel.context` on each device's chunk of the sequence.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from spmd_train.kernels.flash_attention import BlockSizes, flash_attention
from spmd_train.ops.attention import dot_product_attention
from spmd_train.parallel.backends import Backends
from spmd_train.parallel.context import AXIS, context_attention
from spmd_train.sharding.arithmetic import entry_axes, manual_axes, without_axes
from spmd_train.sharding.constrain import active_layout


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, backends: Backends,
              segments: jax.Array | None = None) -> jax.Array:
    """Causal grouped-query attention, q [b, l, h, d] and k/v [b, l, kvh, d] -> [b, l, h, d].

    `backends` (resolved when the engine was built) says which implementation runs and how, and
    with `sequence` > 1 which context-parallel scheme joins the devices' chunks of the sequence.
    `segments` [b, l]: each token's document; a query sees only keys of its own document."""
    layout = active_layout()
    local = local_kernel(backends)
    if backends.context is not None and layout is not None:
        def kernel(*args):
            q, k, v, *seg = args
            return context_attention(q, k, v, seg[0] if seg else None, how=backends.context,
                                     ways=backends.sequence, kernel=local)
        return _per_device(kernel, q, k, v, segments, layout, length=(AXIS,))
    if backends.attention == "xla":
        return dot_product_attention(q, k, v, causal=True, segment_ids=segments)
    kernel = lambda q, k, v, seg=None: local(q, k, v, seg, True, False)
    if layout is None:
        return kernel(q, k, v) if segments is None else kernel(q, k, v, segments)
    return _per_device(kernel, q, k, v, segments, layout, length=())


def local_kernel(backends: Backends):
    """kernel(q, k, v, segments, causal, return_lse) for one device's arrays, by implementation."""
    if backends.attention == "xla":
        return lambda q, k, v, seg, causal, lse: dot_product_attention(q, k, v, causal=causal, segment_ids=seg,
                                                                       return_lse=lse)
    if backends.attention == "pallas":
        blocks = BlockSizes(*backends.blocks)
        return lambda q, k, v, seg, causal, lse: flash_attention(
            q, k, v, causal=causal, segment_ids=seg, block_sizes=blocks, return_lse=lse,
            interpret=backends.interpret, backend=backends.kernels)
    if backends.attention == "cudnn":
        def cudnn(q, k, v, seg, causal, lse):
            if lse or not causal or isinstance(seg, tuple):
                raise ValueError("cuDNN through jax.nn.dot_product_attention returns no log-sum-exp: "
                                 "parallel.context_parallel=allgather or ring needs backends.attention="
                                 "pallas or xla (or use ulysses)")
            return cudnn_attention(q, k, v, seg)
        return cudnn
    raise ValueError(f"attention implementation {backends.attention!r} is not one of: pallas, cudnn, xla")


def _per_device(kernel, q, k, v, segments, layout, *, length: tuple[str, ...]) -> jax.Array:
    """Run `kernel` on each device's q, k, v (and segments) in a region manual over every mesh axis.

    `length`: the mesh axes the activations' `length` must be split over (the region's kernel
    assumes exactly those chunks)."""
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
    return jax.shard_map(kernel, mesh=mesh, in_specs=specs, out_specs=q_spec, axis_names=axes,
                         check_vma=False)(*args)


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None = None, *,
                    implementation: str = "cudnn") -> jax.Array:
    """cuDNN's fused attention through `jax.nn.dot_product_attention`, causal, documents as a dense mask.

    That API takes no segment ids, so documents become a [b, 1, l, l] boolean mask (memory
    quadratic in length): `backends.attention=auto` picks our Pallas kernels on GPU when
    documents are masked. `implementation="xla"` runs the same call anywhere (for tests).
    """
    mask = None if segments is None else segments[:, None, :, None] == segments[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)

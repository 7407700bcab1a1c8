"""Attention by implementation name, with kernels run per device inside `shard_map`.

Mosaic kernels cannot be partitioned by the compiler, so under an active layout the Pallas
(and cuDNN) paths are wrapped in a `shard_map` over the mesh axes that split batch and heads;
the activations' logical rules say which those are. Length must not be split (context
parallelism is a separate ring-attention path).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from spmd_train.kernels.flash_attention import BlockSizes, flash_attention
from spmd_train.ops.attention import dot_product_attention
from spmd_train.parallel.backends import Backends
from spmd_train.sharding.arithmetic import manual_axes, without_axes
from spmd_train.sharding.constrain import active_layout


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, backends: Backends,
              segments: jax.Array | None = None) -> jax.Array:
    """Causal grouped-query attention, q [b, l, h, d] and k/v [b, l, kvh, d] -> [b, l, h, d].

    `backends` (resolved when the engine was built) says which implementation runs and how.
    `segments` [b, l]: each token's document; a query sees only keys of its own document."""
    if backends.attention == "xla":
        return dot_product_attention(q, k, v, causal=True, segment_ids=segments)
    if backends.attention == "pallas":
        blocks = BlockSizes(*backends.blocks)
        kernel = lambda q, k, v, seg=None: flash_attention(q, k, v, causal=True, segment_ids=seg, block_sizes=blocks,
                                                           interpret=backends.interpret, backend=backends.kernels)
    elif backends.attention == "cudnn":
        kernel = cudnn_attention
    else:
        raise ValueError(f"attention implementation {backends.attention!r} is not one of: pallas, cudnn, xla")
    args = (q, k, v) if segments is None else (q, k, v, segments)
    layout = active_layout()
    if layout is None:
        return kernel(*args)
    manual = manual_axes()
    q_spec = without_axes(layout.activation_spec(P("batch", "length", "heads", "head_dim")), manual)
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

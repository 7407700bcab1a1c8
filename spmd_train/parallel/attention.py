"""Attention by implementation name, with kernels run per device inside `shard_map`.

Mosaic kernels cannot be partitioned by the compiler, so under an active layout the Pallas
(and cuDNN) paths are wrapped in a `shard_map` over the mesh axes that split batch and heads;
the activations' logical rules say which those are. Length must not be split (context
parallelism is a separate ring-attention path).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from spmd_train.kernels.flash_attention import TPU_VMEM_BUDGET, BlockSizes, flash_attention, tpu_vmem_bytes
from spmd_train.models.layers import dot_product_attention
from spmd_train.sharding.constrain import active_layout

IMPLEMENTATIONS = ("auto", "pallas", "cudnn", "xla")


def resolve(impl: str, platform: str, fits_kernel: bool = True) -> str:
    """The implementation `auto` means on a platform: Pallas on TPU, cuDNN on GPU, XLA on CPU.

    GPUs get cuDNN until our Mosaic GPU kernels have been checked and timed against it on an
    H200 (`pallas` selects them); on CPU the Pallas kernels run only when asked for, in
    interpret mode. On TPU, block sizes too large for the kernels'
    VMEM budget (`fits_kernel` false) fall back to XLA; the kernels tile any length.
    """
    if impl != "auto":
        return impl
    if platform == "tpu":
        return "pallas" if fits_kernel else "xla"
    return {"gpu": "cudnn"}.get(platform, "xla")


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, impl: str = "auto",
              blocks: tuple[int, int] | None = None) -> jax.Array:
    """Causal grouped-query attention, q [b, l, h, d] and k/v [b, l, kvh, d] -> [b, l, h, d].

    `blocks`: (block_q, block_k) for the Pallas kernels, None for their per-backend defaults."""
    layout = active_layout()
    platform = layout.mesh.devices.flat[0].platform if layout is not None else jax.devices()[0].platform
    abstract = jax.sharding.get_abstract_mesh()
    manual = set(abstract.manual_axes) if not abstract.empty else set()
    if layout is not None:
        q_spec = _free(layout.activation_spec(P("batch", "length", "heads", "head_dim")), manual)
        kv_spec = _free(layout.activation_spec(P("batch", "length", "kv_heads", "head_dim")), manual)
        mesh = abstract if manual else layout.mesh
        local_q, local_kv = _local(q.shape, q_spec, mesh), _local(k.shape, kv_spec, mesh)
    else:
        local_q, local_kv = q.shape, k.shape
    block_sizes = BlockSizes(*blocks) if blocks is not None else None
    impl = resolve(impl, platform, tpu_vmem_bytes(local_q, local_kv, q.dtype, block_sizes) <= TPU_VMEM_BUDGET)
    if impl == "xla":
        return dot_product_attention(q, k, v, causal=True)
    if impl == "pallas":
        kernel = lambda q, k, v: flash_attention(q, k, v, causal=True, block_sizes=block_sizes,  # noqa: E731
                                                 interpret=platform == "cpu")
    elif impl == "cudnn":
        kernel = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,  # noqa: E731
                                                              implementation="cudnn")
    else:
        raise ValueError(f"model.attention={impl!r} is not an implementation (valid: {', '.join(IMPLEMENTATIONS)})")
    if layout is None:
        return kernel(q, k, v)
    # Mosaic kernels need every mesh axis manual, not only those that split batch and heads;
    # along the others each device simply holds (and computes) the whole thing.
    axes = set(mesh.axis_names) - manual
    if not axes:
        return kernel(q, k, v)
    return jax.shard_map(kernel, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                         axis_names=axes, check_vma=False)(q, k, v)


def _local(shape, spec: P, mesh) -> tuple[int, ...]:
    """Per-device shape of an array with this spec."""
    out = list(shape)
    for dim, e in enumerate(spec):
        for axis in (e,) if isinstance(e, str) else e or ():
            out[dim] //= mesh.shape[axis]
    return tuple(out)


def _free(spec: P, manual: set[str]) -> P:
    """The spec without axes an enclosing shard_map already made manual."""
    def keep(e):
        if e is None:
            return None
        axes = tuple(a for a in ((e,) if isinstance(e, str) else e) if a not in manual)
        return None if not axes else axes[0] if len(axes) == 1 else axes

    return P(*(keep(e) for e in spec))

"""The context-parallel section of `spmd-train describe`: how attention joins the `sequence` chunks, by formula.

Per attention layer and microbatch, the collectives over `sequence` each scheme (allgather, ulysses, ring) runs
and the bytes each device sends, computed from the config, the mesh and the layout (nothing is compiled).
`describe` puts the compiled program's collectives beside them, and tests/test_context.py holds the two equal.

Derivation: docs/context.md#how-describe-predicts-the-bytes
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from spmd_train.parallel.context import AXIS, kv_repeats
from spmd_train.sharding.arithmetic import entry_axes, rows_per_device, ways


def context_section(engine) -> dict[str, Any] | None:
    """Context-parallel layout and expected `sequence` traffic of an `Engine`'s train step; None without it.

    Keys: implementation, kernel (the local attention), ways (mesh.sequence), layout ("contiguous"
    or "zigzag"), tokens_per_device, chunk_tokens, kv_block_bytes (one device's K or V of one
    layer), collectives ({op: {count, bytes_per_device}} per step), exact, formula.
    """
    cfg, backends = engine.cfg, engine.backends
    if backends.context is None:
        return None
    m, t, layout, sizes = cfg.model, cfg.train, engine.layout, dict(engine.mesh.shape)
    n, how = backends.sequence, backends.context
    heads = m.num_heads // ways(entry_axes(layout.activation_spec(P(None, None, "heads")), 2), sizes)
    kv_heads = m.num_kv_heads // ways(entry_axes(layout.activation_spec(P(None, None, "kv_heads")), 2), sizes)
    rows = rows_per_device(cfg, sizes)
    local = t.seq_len // n
    width = jnp.dtype(m.compute_dtype).itemsize
    block = rows * local * kv_heads * m.resolved_head_dim * width
    ids = rows * local * 4
    share = (n - 1) / n
    forward: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    backward: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])

    def add(table, op, count, each):
        table[op][0] += count
        table[op][1] += count * each

    once: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # per microbatch, not per layer
    documents = cfg.data.masks_documents
    if how == "allgather":
        add(forward, "all-gather", 2, block * n * share)
        add(backward, "reduce-scatter", 2, block * n * share)
        if documents:
            add(once, "all-gather", 1, ids * n * share)
    elif how == "ulysses":
        qkv = rows * local * (heads + 2 * kv_heads * kv_repeats(kv_heads, n)) * m.resolved_head_dim * width
        out = rows * local * heads * m.resolved_head_dim * width
        for table in (forward, backward):
            add(table, "all-to-all", 1, qkv * share)
            add(table, "all-to-all", 1, out * share)
        if documents:
            add(once, "all-gather", 1, ids * n * share)
    else:
        add(forward, "collective-permute", 2 * (n - 1), block)
        add(backward, "collective-permute", 2 * (n - 1), block)
        add(backward, "collective-permute", 2 * (n - 1), block * 4 // width)
        add(backward, "collective-permute", 2, block)
        if documents:
            add(once, "collective-permute", n - 1, ids)
    remat = cfg.parallel.remat
    layers = m.num_layers * t.grad_accum
    again = 2 if remat == "full" and how != "ring" else 1
    collectives: dict[str, dict[str, float]] = {}
    for table, times in ((forward, layers * again), (backward, layers), (once, t.grad_accum)):
        for op, (count, total) in table.items():
            entry = collectives.setdefault(op, {"count": 0, "bytes_per_device": 0.0})
            entry["count"] += times * count
            entry["bytes_per_device"] += times * total
    return {
        "implementation": how,
        "kernel": backends.attention,
        "ways": n,
        "layout": "zigzag" if how == "ring" else "contiguous",
        "tokens_per_device": local,
        "chunk_tokens": local // 2 if how == "ring" else local,
        "kv_block_bytes": block,
        "collectives": collectives,
        "exact": remat in ("none", "full") and sizes["pipeline"] == 1,
        "formula": f"{m.num_layers} layers x {t.grad_accum} microbatches x the per-layer collectives of "
                   f"{how} (docs/context.md) with r={rows} rows, {local} tokens, {heads} heads and {kv_heads} K/V "
                   f"heads per device, {width}-byte activations"
                   + ("; full remat repeats the forward's" if again == 2 else "")
                   + ("; document ids once per microbatch" if documents else ""),
    }


def compiled_over_sequence(collectives, ops) -> dict[str, dict[str, float]]:
    """The compiled program's collectives of these ops over `sequence` alone: {op: {count, bytes_per_device}}.

    Attention's ops only: the gradients' all-reduce over `sequence` (parameters are replicated over
    it) and the halo of the token shift (a row of targets) are not attention's.
    """
    out: dict[str, dict[str, float]] = {op: {"count": 0, "bytes_per_device": 0.0} for op in ops}
    for c in collectives:
        if tuple(c.axes) == (AXIS,) and c.op in out:
            entry = out.setdefault(c.op, {"count": 0, "bytes_per_device": 0.0})
            entry["count"] += c.count
            entry["bytes_per_device"] += c.bytes
    return out


"""The context-parallel section of `spmd-train describe`: how attention joins the `sequence` chunks, by formula.

Per attention layer and microbatch, the collectives over `sequence` each scheme (allgather, ulysses, ring) runs
and the bytes each device sends: the analytic model's (`analysis.plan.comm.context_terms`, what `plan` counts)
for the engine's layout (nothing is compiled).
`describe` puts the compiled program's collectives beside them, and tests/test_context.py holds the two equal.

Derivation: docs/context.md#how-describe-predicts-the-bytes
"""

from __future__ import annotations

from typing import Any

from spmd_train.analysis.analytic import AnalyticLayout, analytic_layout
from spmd_train.analysis.plan.candidate import rows_per_device, ways
from spmd_train.analysis.plan.comm import context_terms
from spmd_train.config.mesh_schema import RECOMPUTES_LAYER
from spmd_train.parallel.context import AXIS


def context_section(engine, layout: AnalyticLayout | None = None) -> dict[str, Any] | None:
    """Context-parallel layout and expected `sequence` traffic of an `Engine`'s train step; None without it.

    Keys: implementation, kernel (the local attention), ways (mesh.sequence), layout ("contiguous"
    or "zigzag"), tokens_per_device, chunk_tokens, kv_block_bytes (one device's K or V of one
    layer), collectives ({op: {count, bytes_per_device}} per step, the analytic model's `context_terms`),
    exact, formula. `layout`: the engine's `analytic_layout`, when the caller has it.
    """
    cfg, backends = engine.cfg, engine.backends
    if backends.context is None:
        return None
    a = layout or analytic_layout(engine)
    m, t, c = a.shape, cfg.train, a.candidate
    n, how = backends.sequence, backends.context
    heads = m.num_heads // ways(c.split_by("heads"), c.shape)
    kv_heads = m.num_kv_heads // ways(c.split_by("kv_heads"), c.shape)
    rows = rows_per_device(c, a.workload)
    local = t.seq_len // n
    width = m.compute_bytes
    collectives = {term.op: {"count": term.count, "bytes_per_device": term.bytes}
                   for term in context_terms(m, c, a.workload)}
    remat = cfg.parallel.remat
    again = remat in RECOMPUTES_LAYER and how != "ring"
    return {
        "implementation": how,
        "kernel": backends.attention,
        "ways": n,
        "layout": "zigzag" if how == "ring" else "contiguous",
        "tokens_per_device": local,
        "chunk_tokens": local // 2 if how == "ring" else local,
        "kv_block_bytes": rows * local * kv_heads * m.head_dim * width,
        "collectives": collectives,
        "exact": (remat == "none" or remat in RECOMPUTES_LAYER - {"names"}) and c.pipeline == 1,
        "formula": f"{m.num_layers} layers x {t.grad_accum} microbatches x the per-layer collectives of "
                   f"{how} (docs/context.md) with r={rows} rows, {local} tokens, {heads} heads and {kv_heads} K/V "
                   f"heads per device, {width}-byte activations"
                   + ("; full remat repeats the forward's" if again else "")
                   + ("; document ids once per microbatch" if a.workload.documents else ""),
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


"""Bytes attention keeps for its backward pass, per query token on one device, by kernel, remat policy and
context-parallel scheme (`parallel.context`).

Each figure is what jax.vjp keeps, traced: tests/test_plan_model.py compares them with the residuals of a traced
`context_attention` on 4 devices for every scheme, kernel and policy.

Derivation: docs/explanation/planner-model.md#attentions-residuals-by-context-parallel-scheme
"""

from __future__ import annotations

from spmd_train.analysis.plan.shape import ModelShape

PV_PRODUCTS = {"ring": lambda n: 1 + 1.5 * (n - 1), "allgather": lambda n: n}
"""Under save_matmuls with XLA's attention: how many [tokens, H, hd] probability-times-V products the scheme's dots
keep (`ulysses` and one device: one)."""


def attention_residual_bytes(m: ModelShape, policy: str, *, heads: float, kv: float, context: int, attention: str,
                             scheme: str | None = None, ways: int = 1) -> float:
    """Bytes attention keeps per local query token under remat `policy` ("none" or a save_matmuls policy), with
    `heads`/`kv` heads on the device, `context` keys, kernel `attention` ("flash" or "xla") and context-parallel
    `scheme` over `ways` devices (None: the sequence on one device)."""
    c, hd = m.compute_bytes, m.head_dim
    xla = attention == "xla"
    if ways == 1:
        scheme = None
    if policy != "none":
        kept = c * (heads + 2 * kv) * hd
        if xla and policy == "save_matmuls":
            products = PV_PRODUCTS[scheme](ways) if scheme in PV_PRODUCTS else 1
            kept += 4 * heads * context + c * heads * hd * products
        return kept
    if scheme == "ring":
        return c * (2 * heads + 2 * kv) * hd + 4 * heads
    if scheme == "allgather":
        if xla:
            chunk = (heads * context / ways * (13 + c) + (2 * c + 4) * heads * hd + 2 * c * kv * hd + 33 * heads)
        else:
            chunk = (3 * c + 4) * heads * hd + 2 * c * kv * hd + 24 * heads
        return c * heads * hd + ways * chunk + 4 * heads * hd + 8 * heads
    kept = c * (2 * heads + 2 * kv) * hd + (heads * (4 + c) * context + 8 * heads if xla else 4 * heads)
    if scheme == "ulysses" and not xla:  # the kernel keeps its head-split output, the projection the all-to-all's
        kept += c * heads * hd
    return kept

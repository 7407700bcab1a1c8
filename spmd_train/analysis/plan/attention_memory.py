"""Bytes attention keeps for its backward pass, per query token on one device, by kernel, remat policy and
context-parallel scheme (`parallel.context`).

What jax.vjp keeps, traced (tests/test_plan_model.py compares these with the residuals of a traced
`context_attention` on 4 devices for every scheme, kernel and policy). With c = compute bytes, H/KV the query
and K/V heads on the device (after the `tensor` split), hd their width, s the context and n = `sequence`:

- one device's whole sequence, or `ulysses` (full-length attention over H/n heads after its all-to-all: the same
  bytes per local token): q, k, v and the output, c·(2H + 2KV)·hd, and the log-sum-exp 4H with a flash kernel,
  or XLA's fp32 probabilities and their cast (4 + c)·H·s with the row max and sum 8H; under `ulysses` a flash
  kernel's own output (head-split) is a second c·H·hd beside the all-to-all's that the projection keeps;
- `ring`: its custom VJP keeps q, k, v, its output and log-sum-exp whatever the kernel, c·(2H + 2KV)·hd + 4H,
  and reruns each block's attention in the backward pass: with XLA's attention no [s, s] scores stay;
- `allgather`: a scan over the n chunks of the gathered K/V with a `switch` per chunk (past, diagonal, future),
  so each chunk's residuals are stacked n times, the switch's branches sharing buffers of one shape. Per chunk,
  with a flash kernel: the kernel's q and output in its layout and the block's output, 3c·H·hd, the fp32
  merged output 4·H·hd, the chunk's K/V 2c·KV·hd and six fp32 row vectors (block and merged log-sum-exps and
  their weights) 24H; with XLA's attention: the chunk's [s/n, s/n] scores as three fp32 arrays, their cast
  and the bool mask, (13 + c)·H·s/n, q and the block's output 2c·H·hd, the fp32 merge 4·H·hd, K/V 2c·KV·hd
  and 33H of row statistics. Outside the scan: the fp32 merged output and two row vectors, 4·H·hd + 8H, and
  the output the projection keeps, c·H·hd. llama3-8b at n = 8 with a flash kernel: 19x what `ring` keeps;
- save_matmuls (dots_saveable): q, k, v, c·(H + 2KV)·hd, and with XLA's attention its dots' outputs, the
  fp32 scores 4·H·s and the [·, hd] products: once (c·H·hd) on one device, once per chunk under `allgather`
  (n·c·H·hd), and under `ring` 1.5 per ring step after the first, whose two `cond` branches' dots are both
  kept (c·H·hd·(1 + 1.5(n - 1))). A flash kernel is not a dot: it is rerun; save_matmuls_no_batch keeps no
  attention dot either (they have batch dimensions).
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

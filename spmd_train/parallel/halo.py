"""Sliding-window attention over ring attention's zigzag chunks: each chunk needs only the window - 1 keys before
it, so devices swap those tails with their two neighbours instead of passing every block round the ring.

Device i holds chunks i and 2N-1-i of 2N (`parallel.ring.zigzag_order`). Chunk i's predecessor, chunk i-1, is
device i-1's first chunk; chunk 2N-1-i's, chunk 2N-2-i, is device i+1's second chunk, except on device N-1, whose
own first chunk (N-1) precedes its second (N). So one `ppermute` sends every first chunk's tail up the ring, one
sends every second chunk's tail down, and each chunk attends over [predecessor's tail, itself] with its queries
placed window - 1 positions in: 2 (window - 1) keys and values moved per device and layer, whatever the length.
Autodiff differentiates it as written (the transposes of the two ppermutes carry the tails' gradients home).

Derivation: docs/context.md#ring
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spmd_train.ops.attention import Scoring
from spmd_train.parallel.ring import AXIS

NO_DOCUMENT = jnp.iinfo(jnp.int32).min
"""The segment id of halo keys no query may see (device 0's first chunk has no predecessor)."""


def halo_attention(q, k, v, segments, ways: int, kernel, scoring: Scoring, *, return_lse: bool = False):
    """Windowed causal attention of this device's zigzag chunk pair (q, k, v [b, 2c, heads, d], segments [b, 2c] or
    None) when window - 1 <= c: the kernel's (out, lse) or out, as `ring.ring_attention` returns them."""
    n, c, w = ways, q.shape[1] // 2, scoring.window - 1
    if w > c:
        raise ValueError(f"a window of {scoring.window} reaches past the chunk before it ({c} tokens): the halo "
                         "exchange needs window - 1 <= seq_len / (2 x sequence) (the config checks refuse this)")
    me = jax.lax.axis_index(AXIS)
    seg = jnp.zeros(q.shape[:2], jnp.int32) if segments is None else segments.astype(jnp.int32)
    first, second = (lambda x: x[:, :c]), (lambda x: x[:, c:])
    tail = lambda x: x[:, c - w:]
    # Up: first chunks' tails to device i + 1. Down: second chunks' tails to device i - 1.
    up = jax.lax.ppermute([tail(first(a)) for a in (k, v, seg)], AXIS, [(i, (i + 1) % n) for i in range(n)])
    down = jax.lax.ppermute([tail(second(a)) for a in (k, v, seg)], AXIS, [(i, (i - 1) % n) for i in range(n)])
    # Device 0's first chunk starts the sequence: its halo (device N-1's, wrapped round) is no one's document.
    up[2] = jnp.where(me == 0, NO_DOCUMENT, up[2])
    # Device N-1's second chunk follows its own first.
    down = [jnp.where(me == n - 1, tail(first(a)), b) for a, b in zip((k, v, seg), down, strict=True)]

    def chunk(part, halo):
        hk, hv, hs = halo
        keys, values = jnp.concatenate([hk, part(k)], axis=1), jnp.concatenate([hv, part(v)], axis=1)
        return kernel(part(q), keys, values, (part(seg), jnp.concatenate([hs, part(seg)], axis=1)), True, True,
                      scoring, w)

    (out_a, lse_a), (out_b, lse_b) = chunk(first, up), chunk(second, down)
    out = jnp.concatenate([out_a, out_b], axis=1)
    return (out, jnp.concatenate([lse_a, lse_b], axis=2)) if return_lse else out

"""Ring attention: K/V blocks travel a `ppermute` ring over `sequence`, with zigzag load balance.

Each device holds chunks i and 2N-1-i of 2N, so under the causal mask every device does the same work. The
backward is explicit (`jax.custom_vjp`): K/V go round again with fp32 dK/dV accumulators, and each block's
gradient is the kernel's own VJP. No device ever holds more than two K/V blocks.

Derivation: docs/context.md#ring
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from spmd_train.parallel.blockwise import empty, finish, merge

AXIS = "sequence"


def zigzag_order(length: int, ways: int) -> np.ndarray:
    """Token order that gives device i chunks i and 2N-1-i of 2N when `length` is split over `ways` devices."""
    chunk = length // (2 * ways)
    pieces = [np.arange(c * chunk, (c + 1) * chunk) for i in range(ways) for c in (i, 2 * ways - 1 - i)]
    return np.concatenate(pieces)


def ring_attention(q, k, v, segments, ways: int, kernel, *, return_lse: bool = False):
    """Causal attention of this device's zigzag chunk pair of queries over the whole sequence (and its log-sum-exp
    [b, h, lq] with `return_lse`, differentiable, for attention sinks)."""
    out, lse = _ring(q, k, v, segments, ways, kernel)
    return (out, lse) if return_lse else out


def _send(x, n):
    return jax.tree.map(lambda a: jax.lax.ppermute(a, AXIS, [(i, (i + 1) % n) for i in range(n)]), x)


def _first(x, axis=1):
    """The first half of `x` along `axis` (the device's earlier chunk); None stays None."""
    return None if x is None else jnp.split(x, 2, axis=axis)[0]


def _second(x, axis=1):
    """The second half of `x` along `axis` (the device's later chunk); None stays None."""
    return None if x is None else jnp.split(x, 2, axis=axis)[1]


def _pair(seg_q, seg_kv):
    return None if seg_q is None else (seg_q, seg_kv)


def _forward(q, k, v, segments, n, kernel):
    me = jax.lax.axis_index(AXIS)
    block = (k, v, segments)
    merged = empty(q)
    for step in range(n):
        arriving = _send(block, n) if step < n - 1 else None
        kb, vb, sb = block
        if step == 0:
            merged = merge(merged, *kernel(q, k, v, segments, True, True))
        else:
            def earlier(kb=kb, vb=vb, sb=sb):  # the block's second chunk is in every query's future
                return kernel(q, _first(kb), _first(vb), _pair(segments, _first(sb)), False, True)

            def later(kb=kb, vb=vb, sb=sb):  # only the second query chunk sees this block, all of it
                out, lse = kernel(_second(q), kb, vb, _pair(_second(segments), sb), False, True)
                return (jnp.concatenate([jnp.zeros_like(out), out], axis=1),
                        jnp.concatenate([jnp.full_like(lse, -jnp.inf), lse], axis=2))

            merged = merge(merged, *jax.lax.cond(step <= me, earlier, later))
        block = arriving
    return finish(merged, q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _ring(q, k, v, segments, n, kernel):
    return _forward(q, k, v, segments, n, kernel)


def _ring_fwd(q, k, v, segments, n, kernel):
    out, lse = _forward(q, k, v, segments, n, kernel)
    return (out, lse), (q, k, v, segments, out, lse)


def _block_grads(kernel, q, k, v, segments, causal, out, lse, d_out, d_lse):
    """dq, dk, dv of one block's share of the merged output and log-sum-exp, through the kernel's VJP."""
    (out_b, lse_b), vjp = jax.vjp(lambda q, k, v: kernel(q, k, v, segments, causal, True), q, k, v)
    weight = jnp.exp(lse_b - lse)  # the block's share of each row; 0 where the row sees none of it
    rows = jnp.swapaxes(weight, 1, 2)[..., None]
    d_out32 = d_out.astype(jnp.float32)
    # d lse / d lse_b is the block's share too: the merged log-sum-exp's cotangent adds to the block's.
    spread = jnp.swapaxes(jnp.sum(d_out32 * (out_b.astype(jnp.float32) - out.astype(jnp.float32)), -1), 1, 2)
    return vjp(((rows * d_out32).astype(out_b.dtype), weight * (spread + d_lse)))


def _ring_bwd(n, kernel, residuals, cotangents):
    q, k, v, segments, out, lse = residuals
    d_out, d_lse = cotangents
    me = jax.lax.axis_index(AXIS)
    f32 = lambda x: x.astype(jnp.float32)
    dq, dk, dv = map(f32, _block_grads(kernel, q, k, v, segments, True, out, lse, d_out, d_lse))
    block, grads = (k, v, segments), (dk, dv)
    for step in range(1, n):
        block = _send(block, n)  # issued before this step's compute, which needs it, and the previous send
        grads = _send(grads, n)
        kb, vb, sb = block

        def earlier(kb=kb, vb=vb, sb=sb):
            gq, gk, gv = map(f32, _block_grads(kernel, q, _first(kb), _first(vb), _pair(segments, _first(sb)), False,
                                               out, lse, d_out, d_lse))
            pad = lambda g: jnp.concatenate([g, jnp.zeros_like(g)], axis=1)
            return gq, pad(gk), pad(gv)

        def later(kb=kb, vb=vb, sb=sb):
            gq, gk, gv = map(f32, _block_grads(kernel, _second(q), kb, vb, _pair(_second(segments), sb), False,
                                               _second(out), _second(lse, axis=2), _second(d_out),
                                               _second(d_lse, axis=2)))
            return jnp.concatenate([jnp.zeros_like(gq), gq], axis=1), gk, gv

        gq, gk, gv = jax.lax.cond(step <= me, earlier, later)
        dq, grads = dq + gq, (grads[0] + gk, grads[1] + gv)
    # Home: the accumulators of this device's own block, already in K/V's dtype (the same rounding
    # as casting on arrival, at half the bytes in bf16).
    dk, dv = _send((grads[0].astype(k.dtype), grads[1].astype(v.dtype)), n)
    return dq.astype(q.dtype), dk, dv, None


_ring.defvjp(_ring_fwd, _ring_bwd)

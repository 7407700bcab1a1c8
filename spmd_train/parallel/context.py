"""Context parallelism: attention when the tokens of every activation are split over `sequence`.

Outside attention nothing crosses devices; attention needs the other devices' keys. Three schemes run per device
inside the attention region: `ring` (K/V blocks round a ppermute ring, `parallel.ring`), `allgather` (K/V
gathered, merged chunk by chunk by log-sum-exp) and `ulysses` (two all-to-alls between length- and head-split).

Derivation (collectives, bytes, load balance): docs/context.md#allgather-default and the sections after it
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from spmd_train.ops.attention import FULL, Scoring
from spmd_train.parallel.blockwise import empty, finish, merge, nothing
from spmd_train.parallel.halo import halo_attention
from spmd_train.parallel.head_groups import kv_repeats
from spmd_train.parallel.ring import AXIS, ring_attention

IMPLEMENTATIONS = ("ring", "allgather", "ulysses")

# kernel(q, k, v, segments, causal, return_lse) -> out [b, lq, h, d], or (out, lse [b, h, lq]) with
# return_lse; segments is None, one [b, l] array for both sides, or a (q, kv) pair.
Kernel = Callable[..., tuple[jax.Array, jax.Array]]


def context_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None, *, how: str,
                      ways: int, kernel: Kernel, scoring: Scoring = FULL, return_lse: bool = False):
    """Causal attention of this device's chunk of queries over the whole sequence, `ways` chunks on `sequence`
    (and the log-sum-exp [b, h, lq] of its rows with `return_lse`). `scoring` as the kernels take it; `ring`
    with a window swaps chunk tails with its neighbours instead (`parallel.halo`)."""
    if how not in IMPLEMENTATIONS:
        raise ValueError(f"parallel.context_parallel={how!r} is not an implementation "
                         f"(valid: {', '.join(IMPLEMENTATIONS)})")
    if how == "ring":
        if scoring.window is not None:  # the window's keys sit in the neighbours' chunks: no ring needed
            return halo_attention(q, k, v, segments, ways, kernel, scoring, return_lse=return_lse)
        return ring_attention(q, k, v, segments, ways, functools.partial(kernel, scoring=scoring),
                              return_lse=return_lse)
    if how == "allgather":
        out, lse = _allgather(q, k, v, segments, ways, kernel, scoring)
    else:
        return _ulysses(q, k, v, segments, ways, kernel, scoring, return_lse)
    return (out, lse) if return_lse else out


def _gather(x: jax.Array) -> jax.Array:
    return jax.lax.all_gather(x, AXIS, axis=1, tiled=True)


def _allgather(q, k, v, segments, n, kernel, scoring):
    b, lc = q.shape[:2]
    me = jax.lax.axis_index(AXIS)
    chunks = lambda x: jnp.moveaxis(x.reshape(b, n, lc, *x.shape[2:]), 1, 0)  # [n, b, lc, ...]
    k_all, v_all = chunks(_gather(k)), chunks(_gather(v))
    kv_seg = None if segments is None else chunks(_gather(segments))

    def future(q, k, v, seg):
        return nothing(q)

    def behind(distance):
        # Chunk `distance` chunks before the queries' own: a static offset, so the kernel masks the window itself
        # (causal, which a chunk wholly in the past meets anyway, lets the kernels bound their grid by the band).
        return lambda q, k, v, seg: kernel(q, k, v, seg, True, True, scoring, distance * lc)

    if scoring.window is None:  # every earlier chunk is wholly visible
        branches, reach = [future, behind(0), lambda q, k, v, seg: kernel(q, k, v, seg, False, True, scoring)], 1
    else:  # chunks more than `reach` behind hold no key within any query's window
        reach = (scoring.window + lc - 2) // lc
        branches = [future, *(behind(d) for d in range(reach + 1)), future]

    def step(merged, chunk):
        j, kj, vj, sj = chunk
        seg = None if sj is None else (segments, sj)
        at = jnp.clip(me - j + 1, 0, len(branches) - 1) if scoring.window is not None else jnp.sign(me - j) + 1
        return merge(merged, *jax.lax.switch(at, branches, q, kj, vj, seg)), None

    merged, _ = jax.lax.scan(step, empty(q), (jnp.arange(n), k_all, v_all, kv_seg))
    return finish(merged, q.dtype)


def _ulysses(q, k, v, segments, n, kernel, scoring, return_lse):
    repeats = kv_repeats(k.shape[2], n)
    if repeats > 1:
        k, v = jnp.repeat(k, repeats, axis=2), jnp.repeat(v, repeats, axis=2)
    b, lc, h, d = q.shape
    kvh = k.shape[2]
    # Device j's heads of q, k and v side by side, so one all-to-all moves all three.
    per_device = lambda x: x.reshape(b, lc, n, x.shape[2] // n, d)
    qkv = jnp.concatenate([per_device(q), per_device(k), per_device(v)], axis=3)
    qkv = jax.lax.all_to_all(qkv, AXIS, split_axis=2, concat_axis=1, tiled=True)[:, :, 0]
    q, k, v = jnp.split(qkv, [h // n, h // n + kvh // n], axis=2)
    seg = None if segments is None else _gather(segments)
    result = kernel(q, k, v, seg, True, return_lse, scoring)
    out, lse = result if return_lse else (result, None)
    # Back to this device's tokens and every head: heads arrive in device order, for the output and its lse alike.
    out = jax.lax.all_to_all(out, AXIS, split_axis=1, concat_axis=2, tiled=True)
    if not return_lse:
        return out
    return out, jax.lax.all_to_all(lse, AXIS, split_axis=2, concat_axis=1, tiled=True)

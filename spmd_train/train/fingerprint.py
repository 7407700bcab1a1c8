"""Checkpoint fingerprints: two 32-bit sums per array, recorded at save and compared after restore.

Per array, over its values' bit patterns b_i (as unsigned integers) at flat positions i:
  s1 = sum(b_i) mod 2^32,  s2 = sum(b_i * (2i + 1)) mod 2^32.
Integer addition mod 2^32 is associative and commutative, so both are exact whatever the
sharding and reduction order: a state restored onto another mesh has the same fingerprint.
A flipped bit changes s1; values moved to other positions change s2. Computed on device
where the shards live (one pass over the state, a few bytes to the host), with no jax
state in the checkpoint files themselves.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def fingerprint(tree: Any) -> jax.Array:
    """[leaves, 2] uint32: (s1, s2) of each leaf of `tree`, in `jax.tree.leaves` order."""
    rows = []
    for leaf in jax.tree.leaves(tree):
        bits = _bits(leaf)
        weight = (2 * jnp.arange(bits.size, dtype=jnp.uint32) + 1).reshape(bits.shape)
        rows.append(jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weight, dtype=jnp.uint32)]))
    return jnp.stack(rows) if rows else jnp.zeros((0, 2), jnp.uint32)


def differences(recorded: list[list[int]], found: np.ndarray, tree: Any) -> list[str]:
    """Paths of the leaves whose fingerprint differs from the recorded one (all of them if the counts differ)."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    found = np.asarray(found).tolist()
    if len(recorded) != len(found):
        return [f"{len(recorded)} arrays recorded, {len(found)} restored"]
    return [path for path, a, b in zip(paths, recorded, found, strict=True) if list(a) != list(b)]


def _bits(x: jax.Array) -> jax.Array:
    width = jnp.dtype(x.dtype).itemsize
    if width == 8:  # 64-bit values: both halves
        halves = jax.lax.bitcast_convert_type(x, jnp.uint32)
        return halves[..., 0] ^ (halves[..., 1] * jnp.uint32(0x9E3779B1))
    if jnp.dtype(x.dtype) == jnp.bool_:
        return x.astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(x, _UNSIGNED[width]).astype(jnp.uint32)

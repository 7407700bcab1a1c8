"""Reference mixture of experts for tests: a plain loop over experts (jnp) and numpy slot queues."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def reference_routing(x, router, k, score="softmax"):
    """Top-k experts and renormalised gates, [..., d] -> ([..., k] int, [..., k] fp32), written out longhand."""
    logits = jnp.einsum("...d,de->...e", x.astype(jnp.float32), router.astype(jnp.float32))
    scores = jax.nn.softmax(logits, -1) if score == "softmax" else jax.nn.sigmoid(logits)
    idx = jnp.argsort(-scores, axis=-1, stable=True)[..., :k]
    top = jnp.take_along_axis(scores, idx, -1)
    return idx, (jnp.ones_like(top) if k == 1 else top / top.sum(-1, keepdims=True))


def reference_router_losses(x, router, k):
    """(aux, z): E * sum_i (tokens choosing i / tokens) * mean softmax prob of i, and mean logsumexp^2."""
    logits = jnp.einsum("...d,de->...e", x.astype(jnp.float32), router.astype(jnp.float32)).reshape(-1, router.shape[1])
    probs = jax.nn.softmax(logits, -1)
    idx = jnp.argsort(-probs, axis=-1, stable=True)[:, :k]
    chosen = jnp.zeros(probs.shape).at[jnp.arange(probs.shape[0])[:, None], idx].set(1.0)
    aux = probs.shape[1] * jnp.sum(chosen.mean(0) * probs.mean(0))
    z = jnp.mean(jax.scipy.special.logsumexp(logits, axis=-1) ** 2)
    return aux, z


def reference_experts(x, idx, gates, w_gate, w_up, w_down, kept=None):
    """sum over choices c of kept[c] * gate[c] * SwiGLU_{idx[c]}(x), one expert at a time: [..., d] -> [..., d]."""
    kept = jnp.ones(idx.shape, bool) if kept is None else kept
    y = jnp.zeros(x.shape, jnp.float32)
    for e in range(w_gate.shape[0]):
        h = jax.nn.silu(x @ w_gate[e]) * (x @ w_up[e])
        weight = jnp.sum(jnp.where((idx == e) & kept, gates, 0.0), axis=-1)
        y = y + weight[..., None] * (h @ w_down[e])
    return y


def reference_moe(params, x, k, kept=None, score="softmax"):
    """The whole routed layer (no shared experts) from a params dict {router, w_gate, w_up, w_down}."""
    idx, gates = reference_routing(x, params["router"], k, score)
    return reference_experts(x, idx, gates, params["w_gate"], params["w_up"], params["w_down"], kept)


def reference_kept(idx: np.ndarray, num_experts: int, slots: int, groups: int) -> np.ndarray:
    """Which assignments survive capacity: idx [b, l, k] split into `groups` equal runs of batch rows.

    Within a group, each expert's queue is filled by every token's first choice in token
    order (row-major over [rows, length]), then every second choice, and so on.
    """
    b, l, k = idx.shape
    kept = np.zeros(idx.shape, bool)
    rows = b // groups
    for g in range(groups):
        block = idx[g * rows:(g + 1) * rows].reshape(rows * l, k)
        used = np.zeros(num_experts, int)
        ok = np.zeros(block.shape, bool)
        for c in range(k):
            for t in range(rows * l):
                e = block[t, c]
                ok[t, c] = used[e] < slots
                used[e] += 1
        kept[g * rows:(g + 1) * rows] = ok.reshape(rows, l, k)
    return kept


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name, axis_index_groups=None):
    """`lax.ragged_all_to_all` as documented, built from all_gather: runs (and differentiates) on XLA:CPU."""
    assert axis_index_groups is None
    # The real op's result has the type of `output`: it must already vary wherever operand does,
    # or autodiff would (silently) sum the received rows' gradients over those axes.
    assert _varying(operand) <= _varying(output), (_varying(operand), _varying(output))
    ways, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    operands = jax.lax.all_gather(operand, axis_name)
    starts, sizes, dests = (jax.lax.all_gather(a, axis_name)[:, me] for a in (input_offsets, send_sizes,
                                                                               output_offsets))
    del recv_sizes  # implied by the senders' send_sizes
    rows = jnp.arange(output.shape[0])
    result = output
    for source in range(ways):
        inside = (rows >= dests[source]) & (rows < dests[source] + sizes[source])
        taken = jnp.take(operands[source], jnp.clip(starts[source] + rows - dests[source], 0, operand.shape[0] - 1),
                         axis=0)
        result = jnp.where(inside.reshape(-1, *[1] * (output.ndim - 1)), taken, result)
    return result


def _varying(x) -> set[str]:
    """Manual mesh axes x varies over inside shard_map (jax.typeof(x).vma, or .mat.varying in jax 0.10)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "mat", None), "varying", ())
    return set(vma)

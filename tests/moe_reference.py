"""Reference mixture of experts for tests: a plain loop over experts (jnp) and numpy slot queues."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def reference_routing(x, router, k, score="softmax", logit_bias=None):
    """Top-k experts and renormalised gates, [..., d] -> ([..., k] int, [..., k] fp32), written out longhand."""
    logits = jnp.einsum("...d,de->...e", x.astype(jnp.float32), router.astype(jnp.float32))
    if logit_bias is not None:  # gpt-oss: top-k of the biased logits, softmax over the k chosen
        logits = logits + logit_bias
    scores = jax.nn.softmax(logits, -1) if score == "softmax" else jax.nn.sigmoid(logits)
    idx = jnp.argsort(-scores, axis=-1, stable=True)[..., :k]
    top = jnp.take_along_axis(scores, idx, -1)
    return idx, (jnp.ones_like(top) if k == 1 else top / top.sum(-1, keepdims=True))


def reference_router_losses(x, router, k, logit_bias=None):
    """(aux, z): E * sum_i (tokens choosing i / tokens) * mean softmax prob of i, and mean logsumexp^2."""
    logits = jnp.einsum("...d,de->...e", x.astype(jnp.float32), router.astype(jnp.float32)).reshape(-1, router.shape[1])
    logits = logits if logit_bias is None else logits + logit_bias
    probs = jax.nn.softmax(logits, -1)
    idx = jnp.argsort(-probs, axis=-1, stable=True)[:, :k]
    chosen = jnp.zeros(probs.shape).at[jnp.arange(probs.shape[0])[:, None], idx].set(1.0)
    aux = probs.shape[1] * jnp.sum(chosen.mean(0) * probs.mean(0))
    z = jnp.mean(jax.scipy.special.logsumexp(logits, axis=-1) ** 2)
    return aux, z


def reference_experts(x, idx, gates, w_gate, w_up, w_down, kept=None, biases=None, limit=None):
    """sum over choices c of kept[c] * gate[c] * SwiGLU_{idx[c]}(x), one expert at a time: [..., d] -> [..., d].

    `biases` (b_gate, b_up, b_down) and `limit`: gpt-oss's experts, whose SwiGLU clamps the gate from above and
    the up projection both ways, then takes (up + 1) * gate * sigmoid(1.702 gate) (openai/gpt-oss, torch/model.py).
    """
    kept = jnp.ones(idx.shape, bool) if kept is None else kept
    b_gate, b_up, b_down = biases if biases is not None else (jnp.zeros(w_gate.shape[::2]),) * 2 + (
        jnp.zeros((w_down.shape[0], w_down.shape[2])),)
    y = jnp.zeros(x.shape, jnp.float32)
    for e in range(w_gate.shape[0]):
        g, u = x @ w_gate[e] + b_gate[e], x @ w_up[e] + b_up[e]
        if limit is None:
            h = jax.nn.silu(g) * u
        else:
            g, u = jnp.where(g > limit, limit, g), jnp.where(u > limit, limit, jnp.where(u < -limit, -limit, u))
            h = (u + 1.0) * g / (1.0 + jnp.exp(-1.702 * g))
        weight = jnp.sum(jnp.where((idx == e) & kept, gates, 0.0), axis=-1)
        y = y + weight[..., None] * (h @ w_down[e] + b_down[e])
    return y


def reference_moe(params, x, k, kept=None, score="softmax", limit=None):
    """The whole routed layer (no shared experts) from a params dict {router, w_gate, w_up, w_down} and, when
    present, gpt-oss's router_logit_bias and expert biases b_gate, b_up, b_down."""
    idx, gates = reference_routing(x, params["router"], k, score, params.get("router_logit_bias"))
    biases = (params["b_gate"], params["b_up"], params["b_down"]) if "b_gate" in params else None
    return reference_experts(x, idx, gates, params["w_gate"], params["w_up"], params["w_down"], kept, biases, limit)


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

"""A batch turned into what the model and the loss take: shifted inputs and targets, documents, target weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spmd_train.data.batch import Batch, as_batch, loss_weights, scored_weights
from spmd_train.parallel.ring import zigzag_order
from spmd_train.sharding.constrain import constrain


def model_inputs(batch: Batch | jax.Array, zigzag: int = 1
                 ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array], jax.Array | None]:
    """(inputs, targets, the documents' segments and positions of the inputs as keywords, target weights).

    Shift first, then lay out: left to itself the partitioner may split the odd-length token
    array on length and exchange halos to form the shifted views. `zigzag` = N > 1 (ring
    attention over N devices): every per-token array is put in `zigzag_order` before it is laid
    out (a local gather, the rows are not yet split on length), and the inputs' true positions
    travel with them for RoPE; the loss is a mean over tokens, so their order does not matter.
    """
    batch = with_loss_weights(as_batch(batch))
    inputs, targets, weights = batch.tokens[:, :-1], batch.tokens[:, 1:], batch.weights
    segments = batch.segments[:, :-1] if batch.documents else None
    positions = batch.positions[:, :-1] if batch.documents else None
    if zigzag > 1:
        length = inputs.shape[1]
        if positions is None:  # once reordered, RoPE needs every token's true position
            positions = jnp.broadcast_to(jnp.arange(length), inputs.shape)
        order = jnp.asarray(zigzag_order(length, zigzag))
        inputs, targets, weights, segments, positions = (
            None if a is None else a[:, order] for a in (inputs, targets, weights, segments, positions))
    rows = lambda a: constrain(a, ("batch", "length"))
    docs = {name: rows(a) for name, a in (("segments", segments), ("positions", positions)) if a is not None}
    return rows(inputs), rows(targets), docs, None if weights is None else rows(weights)


def mtp_inputs(batch: Batch | jax.Array, depth: int, zigzag: int = 1
               ) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
    """Per multi-token prediction depth k (from 1): (the token k places ahead of each input, the token k + 1 ahead
    (the depth's target), its weight), each [rows, seq_len] and laid out as `model_inputs`' arrays.

    The weights are the batch's `mtp_weights` when the step filled them in for the whole batch, else this batch's
    (`mtp_weights`). Positions past the window's end read token 0 and weigh 0.
    """
    batch = as_batch(batch)
    tokens = batch.tokens
    length = tokens.shape[1] - 1
    weights = batch.mtp_weights if batch.mtp_weights is not None else mtp_weights(batch, depth)
    order = jnp.asarray(zigzag_order(length, zigzag)) if zigzag > 1 else None
    out = []
    for k in range(1, depth + 1):
        arrays = (_pad(tokens[:, k:], k - 1), _pad(tokens[:, k + 1:], k), weights[:, k - 1])
        if order is not None:
            arrays = tuple(a[:, order] for a in arrays)
        out.append(tuple(constrain(a, ("batch", "length")) for a in arrays))
    return out


def mtp_weights(batch: Batch, depth: int) -> jax.Array:
    """[rows, depth, seq_len]: whether depth k's target at each position is scored, as `data.batch.loss_weights`
    weighs the next-token targets (1 / the fraction of the batch scored, or 0; each depth normalised on its own).

    A position is scored when its target, k + 1 tokens on, lies inside the window and, with documents, inside the
    input's document (then every token between does too).
    """
    rows, length = batch.tokens.shape[0], batch.tokens.shape[1] - 1
    out = []
    for k in range(1, depth + 1):
        scored = jnp.broadcast_to(jnp.arange(length) < length - k, (rows, length))
        if batch.documents:
            scored = scored & (batch.segments[:, :length] == _pad(batch.segments[:, k + 1:], k))
        out.append(scored_weights(scored))
    return jnp.stack(out, axis=1)


def _pad(a: jax.Array, n: int) -> jax.Array:
    """`a` [rows, m] with n zero columns appended."""
    return jnp.concatenate([a, jnp.zeros((a.shape[0], n), a.dtype)], axis=1)


def with_loss_weights(batch: Batch, mtp_depth: int = 0) -> Batch:
    """The batch with its target weights, where documents decide which targets are scored (`loss_weights`), and with
    `mtp_depth` > 0 each multi-token prediction depth's (`mtp_weights`).

    Called on the whole batch, before it is split, so the weights normalise by the global count.
    """
    if mtp_depth and batch.mtp_weights is None:
        batch = batch._replace(mtp_weights=mtp_weights(batch, mtp_depth))
    if not batch.documents or batch.weights is not None:
        return batch
    return batch._replace(weights=loss_weights(batch.segments))

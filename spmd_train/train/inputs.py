"""A batch turned into what the model and the loss take: shifted inputs and targets, documents, target weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spmd_train.data.batch import Batch, as_batch, loss_weights
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


def with_loss_weights(batch: Batch) -> Batch:
    """The batch with its target weights, where documents decide which targets are scored (`loss_weights`).

    Called on the whole batch, before it is split, so the weights normalise by the global count.
    """
    if not batch.documents or batch.weights is not None:
        return batch
    return batch._replace(weights=loss_weights(batch.segments))

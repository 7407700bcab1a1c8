"""A batch turned into what the model and the loss take: shifted inputs and targets, documents, target weights."""

from __future__ import annotations

import jax

from spmd_train.data.batch import Batch, as_batch, loss_weights
from spmd_train.sharding.constrain import constrain


def model_inputs(batch: Batch | jax.Array) -> tuple[jax.Array, jax.Array, dict[str, jax.Array], jax.Array | None]:
    """(inputs, targets, the documents' segments and positions of the inputs as keywords, target weights).

    Shift first, then lay out: left to itself the partitioner may split the odd-length token
    array on length and exchange halos to form the shifted views.
    """
    batch = with_loss_weights(as_batch(batch))
    rows = lambda a: constrain(a, ("batch", "length"))
    docs = {} if not batch.documents else {"segments": rows(batch.segments[:, :-1]),
                                           "positions": rows(batch.positions[:, :-1])}
    weights = None if batch.weights is None else rows(batch.weights)
    return rows(batch.tokens[:, :-1]), rows(batch.tokens[:, 1:]), docs, weights


def with_loss_weights(batch: Batch) -> Batch:
    """The batch with its target weights, where documents decide which targets are scored (`loss_weights`).

    Called on the whole batch, before it is split, so the weights normalise by the global count.
    """
    if not batch.documents or batch.weights is not None:
        return batch
    return batch._replace(weights=loss_weights(batch.segments))

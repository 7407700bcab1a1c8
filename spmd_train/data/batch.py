"""What one training step consumes: token windows and, for packed documents, where each document lies.

A window of seq_len + 1 tokens gives seq_len inputs and their shifted targets. With document
masking the batch also carries, per token, its document's index within the row (`segments`,
from 0) and its position inside that document (`positions`, restarting at 0 at each document
start, clipped at the window start), so attention stays inside documents, RoPE sees each
document from position 0, and targets that lie in the next document are not scored.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Batch(NamedTuple):
    """Rows of [seq_len + 1] int32 token windows, with their document layout when documents are masked."""

    tokens: jax.Array | np.ndarray
    segments: jax.Array | np.ndarray | None = None
    """Per token: the index of its document within the row (0, 1, ...), or None (one document per row)."""
    positions: jax.Array | np.ndarray | None = None
    """Per token: its position inside its document (RoPE's position), or None (0, 1, ... along the row)."""
    weights: jax.Array | None = None
    """Per target [rows, seq_len]: `loss_weights` of the whole batch, filled in by the step before it splits the
    batch into microbatches and device shards (sources leave it None)."""
    mtp_weights: jax.Array | None = None
    """Per target [rows, model.mtp.depth, seq_len]: each multi-token prediction depth's weights
    (`train.inputs.mtp_weights`), filled in by the step like `weights` (sources leave it None)."""

    @property
    def documents(self) -> bool:
        """Whether attention and the loss must respect document boundaries."""
        return self.segments is not None


def as_batch(batch: Batch | jax.Array | np.ndarray) -> Batch:
    """A `Batch`; a bare [rows, seq_len + 1] token array is one document per row."""
    return batch if isinstance(batch, Batch) else Batch(batch)


def document_layout(starts: np.ndarray, first: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(segments, positions) of the window [first, first + length) of a stream whose documents begin at `starts`.

    `starts` is sorted; a window that begins inside a document counts that document as segment 0
    and its first token as position 0.
    """
    index = np.arange(first, first + length)
    doc = np.searchsorted(starts, index, side="right")
    segments = (doc - doc[0]).astype(np.int32)
    begin = np.maximum(np.concatenate([[first], np.asarray(starts, np.int64)])[doc], first)
    return segments, (index - begin).astype(np.int32)


def document_layout_from_eot(window: np.ndarray, eot_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(segments, positions) of a window whose documents each end with the token `eot_id`.

    A document starts right after every end-of-document token: the token itself still belongs
    to the document it ends (it is that document's last target).
    """
    ends = np.asarray(window) == eot_id
    segments = np.concatenate([[0], np.cumsum(ends[:-1])]).astype(np.int32)
    starts = np.flatnonzero(np.diff(segments, prepend=0))
    return segments, document_layout(starts, 0, len(window))[1]


def loss_weights(segments: jax.Array) -> jax.Array:
    """Per-target weights [rows, seq_len] whose mean over the whole batch is the mean loss of scored targets.

    A target is scored when it lies in the same document as its input. Each weight is
    1 / (fraction of targets scored in the global batch) or 0, so means over microbatches and
    devices (all the same size) give the exact mean over scored targets of the whole batch.
    """
    return scored_weights(segments[:, 1:] == segments[:, :-1])


def scored_weights(scored: jax.Array) -> jax.Array:
    """Which targets are scored (bool) -> 1 / (the fraction of them scored) where scored, else 0: weights whose mean
    is the mean loss of the scored targets (`loss_weights`, and each multi-token prediction depth's)."""
    scored = scored.astype(jnp.float32)
    return scored * (scored.size / jnp.maximum(jnp.sum(scored), 1.0))

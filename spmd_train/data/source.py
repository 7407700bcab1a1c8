"""What every data source provides, and how a global batch reaches the devices.

A source is a pure function of (seed, step): any host can compute which rows of the global
batch are its own, and reads or generates only those. The loader's position in a run is
therefore just the step number, which checkpoints already store.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding

from spmd_train.data.batch import Batch


class TokenSource:
    """Batches of [global_batch, seq_len + 1] int32 tokens: inputs and their shifted targets."""

    loss_floor: float | None = None
    """Best achievable mean loss (nats per token) where it is known exactly, else None."""
    documents: bool = False
    """Whether batches carry document segments and positions (`Batch`), for document masking."""

    def __init__(self, vocab_size: int, seq_len: int, global_batch: int, seed: int):
        self.vocab_size, self.seq_len, self.global_batch, self.seed = vocab_size, seq_len, global_batch, seed

    def rows(self, step: int, rows: np.ndarray, split: str = "train") -> np.ndarray:
        """The given rows of the step's global batch; sources that can read rows alone override this."""
        return self.global_batch_array(step, split)[rows]

    def global_batch_array(self, step: int, split: str = "train") -> np.ndarray:
        """The whole global batch of a step (0-based), on the host."""
        raise NotImplementedError

    def document_rows(self, step: int, rows: np.ndarray, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
        """(segments, positions) of the given rows, for sources with `documents`."""
        raise NotImplementedError(f"{type(self).__name__} has no documents")

    def batch_shapes(self, sharding: NamedSharding) -> Batch:
        """What `batch` returns as shapes, dtypes and sharding only: the step compiles without a batch made."""
        spec = jax.ShapeDtypeStruct((self.global_batch, self.seq_len + 1), np.int32, sharding=sharding)
        return Batch(spec, spec, spec) if self.documents else Batch(spec)

    def batch(self, step: int, sharding: NamedSharding, split: str = "train") -> Batch:
        """The step's batch as global arrays; this process materialises only the rows its devices hold."""
        shape = (self.global_batch, self.seq_len + 1)
        local = host_rows(sharding, shape)
        put = lambda rows: jax.make_array_from_process_local_data(sharding, rows, shape)
        if not self.documents:
            return Batch(put(self.rows(step, local, split)))
        segments, positions = self.document_rows(step, local, split)
        return Batch(put(self.rows(step, local, split)), put(segments), put(positions))


def host_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> np.ndarray:
    """Indices of the global-batch rows held by this process's devices, in order."""
    spans = {idx[0].indices(shape[0])[:2] for idx in sharding.addressable_devices_indices_map(shape).values()}
    return np.concatenate([np.arange(start, stop) for start, stop in sorted(spans)])

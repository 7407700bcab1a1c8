"""What every data source provides, and how a global batch reaches the devices.

A source is a pure function of (seed, step): any host can compute which rows of the global
batch are its own, and reads or generates only those. The loader's position in a run is
therefore just the step number, which checkpoints already store.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding


class TokenSource:
    """Batches of [global_batch, seq_len + 1] int32 tokens: inputs and their shifted targets."""

    loss_floor: float | None = None
    """Best achievable mean loss (nats per token) where it is known exactly, else None."""

    def __init__(self, vocab_size: int, seq_len: int, global_batch: int, seed: int):
        self.vocab_size, self.seq_len, self.global_batch, self.seed = vocab_size, seq_len, global_batch, seed

    def rows(self, step: int, rows: np.ndarray, split: str = "train") -> np.ndarray:
        """The given rows of the step's global batch; sources that can read rows alone override this."""
        return self.global_batch_array(step, split)[rows]

    def global_batch_array(self, step: int, split: str = "train") -> np.ndarray:
        """The whole global batch of a step (0-based), on the host."""
        raise NotImplementedError

    def batch(self, step: int, sharding: NamedSharding, split: str = "train") -> jax.Array:
        """The step's batch as a global array; this process materialises only the rows its devices hold."""
        shape = (self.global_batch, self.seq_len + 1)
        local = host_rows(sharding, shape)
        return jax.make_array_from_process_local_data(sharding, self.rows(step, local, split), shape)


def host_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> np.ndarray:
    """Indices of the global-batch rows held by this process's devices, in order."""
    spans = {idx[0].indices(shape[0])[:2] for idx in sharding.addressable_devices_indices_map(shape).values()}
    return np.concatenate([np.arange(start, stop) for start, stop in sorted(spans)])

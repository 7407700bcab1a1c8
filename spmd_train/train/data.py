"""Synthetic training tokens: a seeded random successor chain the model can learn.

Each token has `successors` possible next tokens, chosen uniformly, so the best achievable
loss is ln(successors) nats per token. A batch is a pure function of (seed, step) and does
not depend on the mesh, so runs on different layouts see identical data.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import NamedSharding


class SyntheticTokens:
    """Batches of [global_batch, seq_len + 1] int32 tokens (inputs and shifted targets)."""

    def __init__(self, vocab_size: int, seq_len: int, global_batch: int, *, successors: int = 4, seed: int = 0):
        self.vocab_size, self.seq_len, self.global_batch, self.seed = vocab_size, seq_len, global_batch, seed
        table_rng = np.random.default_rng([seed, 0x5EED])
        self.successor_table = np.stack(
            [table_rng.choice(vocab_size, size=min(successors, vocab_size), replace=False) for _ in range(vocab_size)]
        ).astype(np.int32)
        self.loss_floor = math.log(self.successor_table.shape[1])
        """The chain's entropy rate in nats per token: no model can beat it."""

    def global_batch_array(self, step: int) -> np.ndarray:
        """The whole global batch for a step (0-based), on the host."""
        rng = np.random.default_rng([self.seed, step, 1])
        k = self.successor_table.shape[1]
        tokens = np.empty((self.global_batch, self.seq_len + 1), np.int32)
        tokens[:, 0] = rng.integers(0, self.vocab_size, size=self.global_batch)
        choices = rng.integers(0, k, size=(self.global_batch, self.seq_len))
        for pos in range(self.seq_len):
            tokens[:, pos + 1] = self.successor_table[tokens[:, pos], choices[:, pos]]
        return tokens

    def batch(self, step: int, sharding: NamedSharding) -> jax.Array:
        """The step's batch as a global array; each process places only the rows its devices hold."""
        full = self.global_batch_array(step)
        rows = sorted(
            {idx[0].indices(full.shape[0])[:2] for idx in sharding.addressable_devices_indices_map(full.shape).values()}
        )
        local = np.concatenate([full[start:stop] for start, stop in rows]) if len(rows) > 1 else full[slice(*rows[0])]
        return jax.make_array_from_process_local_data(sharding, local, full.shape)

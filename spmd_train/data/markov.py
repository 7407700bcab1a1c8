"""Tokens from a seeded random Markov chain whose entropy rate is known exactly.

Each context (the previous `order` tokens) has a next-token distribution drawn from a
symmetric Dirichlet(`concentration`): small values give peaky, learnable transitions, large
values near-uniform ones. Sequences start from the chain's stationary distribution, so the
expected loss of a perfect model at every position is known in closed form (`loss_floor`).
"""

from __future__ import annotations

import numpy as np

from spmd_train.data.source import TokenSource
from spmd_train.errors import ConfigError

MAX_TABLE = 2**25
"""Most transition probabilities a chain may have (vocab ** (order + 1)): 256 MiB in float64."""


class MarkovChain(TokenSource):
    """Batches [global_batch, seq_len + 1] sampled from an order-k Markov chain; a pure function of (seed, step)."""

    def __init__(self, vocab_size: int, seq_len: int, global_batch: int, *, order: int = 1,
                 concentration: float = 0.1, seed: int = 0):
        super().__init__(vocab_size, seq_len, global_batch, seed)
        if vocab_size ** (order + 1) > MAX_TABLE:
            largest = int(MAX_TABLE ** (1 / (order + 1)))
            raise ConfigError(
                f"data.vocab_size={vocab_size} with data.order={order} needs a transition table of "
                f"{vocab_size ** (order + 1):,} probabilities (over {MAX_TABLE:,}: too much memory); set "
                f"data.vocab_size to at most {largest} (the model's vocabulary may stay larger) or lower data.order")
        self.order = order
        rng = np.random.default_rng([seed, 0x4D41524B])
        contexts = vocab_size**order
        self.transitions = rng.dirichlet(np.full(vocab_size, concentration), size=contexts)
        self._cdf = np.cumsum(self.transitions, axis=1)
        self._cdf[:, -1] = 1.0
        self.stationary = _stationary(self.transitions, vocab_size, order)
        self.loss_floor = self._expected_loss()

    def global_batch_array(self, step: int, split: str = "train") -> np.ndarray:
        """The whole global batch for a step (0-based) on the host."""
        rng = np.random.default_rng([self.seed, step, 0 if split == "train" else 1])
        v, k, b = self.vocab_size, self.order, self.global_batch
        tokens = np.empty((b, self.seq_len + 1), np.int64)
        context = rng.choice(v**k, size=b, p=self.stationary)
        for i in range(k):  # unpack the starting context into its k tokens, oldest first
            tokens[:, i] = (context // v ** (k - 1 - i)) % v
        uniforms = rng.random((b, self.seq_len + 1 - k))
        for pos in range(k, self.seq_len + 1):
            nxt = (self._cdf[context] < uniforms[:, pos - k, None]).sum(axis=1)
            tokens[:, pos] = nxt
            context = (context * v + nxt) % v**k
        return tokens.astype(np.int32)

    def _expected_loss(self) -> float:
        """Mean over target positions 1..seq_len of H(x_t | x_<t) in nats, for sequences started at stationarity."""
        v, k = self.vocab_size, self.order
        row_entropy = -np.sum(self.transitions * np.log(np.maximum(self.transitions, 1e-300)), axis=1)
        rate = float(self.stationary @ row_entropy)
        # Targets before position k see fewer than k tokens: H(x_t | x_<t) = H(x_0..x_t) - H(x_0..x_t-1).
        joint = self.stationary.reshape((v,) * k)
        prefix_entropy = [0.0]
        for t in range(1, k + 1):
            marginal = joint.sum(axis=tuple(range(t, k))) if t < k else joint
            p = marginal.reshape(-1)
            prefix_entropy.append(float(-np.sum(p * np.log(np.maximum(p, 1e-300)))))
        per_target = [prefix_entropy[t + 1] - prefix_entropy[t] for t in range(1, min(k, self.seq_len + 1))]
        per_target += [rate] * (self.seq_len - len(per_target))
        return float(np.mean(per_target))

    @property
    def entropy_rate(self) -> float:
        """Nats per token a perfect model pays once it has seen `order` tokens."""
        row_entropy = -np.sum(self.transitions * np.log(np.maximum(self.transitions, 1e-300)), axis=1)
        return float(self.stationary @ row_entropy)


def _stationary(transitions: np.ndarray, vocab: int, order: int, tol: float = 1e-13) -> np.ndarray:
    """Stationary distribution over contexts (power iteration; the chain is ergodic: all entries > 0)."""
    contexts = vocab**order
    pi = np.full(contexts, 1.0 / contexts)
    shift = (np.arange(contexts) * vocab) % contexts  # context c followed by token x -> shift[c] + x
    for _ in range(10_000):
        nxt = np.zeros(contexts)
        mass = pi[:, None] * transitions
        np.add.at(nxt, (shift[:, None] + np.arange(vocab)[None, :]).reshape(-1), mass.reshape(-1))
        if np.abs(nxt - pi).sum() < tol:
            return nxt / nxt.sum()
        pi = nxt
    return pi / pi.sum()

"""The attention implementations' kernels, by name: one `AttentionBackend` each, registered by its own module.

The facts of each implementation (where it runs, whether it returns the log-sum-exp, the config checks it
needs) are `config.attention_facts`'; the code that computes attention on one device's arrays is registered
here under the same name by a module of `parallel.attention_backends`, whose package imports them all (look
implementations up through it). `parallel.attention_dispatch` runs the kernel, inside `shard_map` where needed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spmd_train.parallel.backends import Backends
from spmd_train.registry import Registry

Kernel = Callable[..., Any]
"""kernel(q, k, v, segments, causal, return_lse, scoring=FULL, q_offset=0) -> out [b, lq, h, d], or (out, lse
[b, h, lq]) with return_lse; q [b, lq, h, d], k/v [b, lk, kvh, d] are one device's arrays, segments [b, l] (or a
(q, k) pair) or None; `scoring` (`ops.attention.Scoring`: scale, soft-cap, window) and `q_offset` (the queries'
position relative to the keys' first) as `ops.attention.dot_product_attention` defines them. Only variants the
implementation's facts list (`AttentionFacts.variants`) reach it."""


@dataclass(frozen=True)
class AttentionBackend:
    """An attention implementation's code: the kernel it runs for a run's resolved `Backends`."""

    name: str
    """backends.attention's value; its `config.attention_facts.AttentionFacts` has the same name."""
    kernel: Callable[[Backends], Kernel]
    """The kernel for this run's settings (block sizes, interpret mode, ...)."""
    partitioned: bool = False
    """XLA partitions it itself (plain jax): without context parallelism it runs outside any `shard_map`
    region. Kernels XLA cannot partition (Pallas, cuDNN) run per device in one."""


_BACKENDS: Registry[AttentionBackend] = Registry("attention implementation")
register_attention = _BACKENDS.add
"""Add an implementation's kernel (ValueError for a name already taken)."""


def attention_backend(name: str) -> AttentionBackend:
    """The implementation registered as `name`; ValueError naming the registered ones for any other."""
    if name not in _BACKENDS:
        raise ValueError(f"attention implementation {name!r} is not one of: {', '.join(_BACKENDS.names())}")
    return _BACKENDS[name]


def registered_attention() -> tuple[str, ...]:
    """The names with a registered kernel, in registration order."""
    return _BACKENDS.names()

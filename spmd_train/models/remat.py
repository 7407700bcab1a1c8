"""Rematerialisation policies for the scanned layer, by name (`parallel.remat`)."""

from __future__ import annotations

from collections.abc import Callable

import jax

# 'none' (no jax.checkpoint) keeps every residual autodiff wants, cheap elementwise ones included (the norms'
# rsqrt, silu's pieces, softmax scores and probabilities): on configs/tiny.yaml that is 26 stacked [layers, ...]
# buffers per device against 1 under 'full', 2.3x the temporaries and 16% more bytes moved per step. A small
# model is bound by memory traffic, not FLOPs, so 'none' steps 6-14% slower than 'full' there although it
# compiles 16% fewer FLOPs; 'save_matmuls' (9 buffers, the matmul outputs) keeps none's FLOPs at 2% over full's
# bytes and steps within 1% of 'full' (benchmarks/remat.py; docs/benchmarks.md, section remat). The cause is
# XLA keeping what autodiff saves, not our layer, so the default stays 'none' (no recompute, which large
# models on accelerators, compute-bound, gain from) and the choice is the user's.
POLICIES: dict[str, Callable | None] = {
    "full": None,  # save nothing: recompute the whole layer in the backward pass
    "save_matmuls": jax.checkpoint_policies.dots_saveable,
    "save_matmuls_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def apply_remat(fn: Callable, name: str) -> Callable:
    """Wrap a layer function in jax.checkpoint with the named policy ('none' returns fn as is)."""
    if name == "none":
        return fn
    if name not in POLICIES:
        raise ValueError(f"parallel.remat={name!r} is not a policy (valid: none, {', '.join(POLICIES)})")
    return jax.checkpoint(fn, policy=POLICIES[name], prevent_cse=False)

"""Rematerialisation policies for the scanned layer, by name (`parallel.remat`)."""

from __future__ import annotations

from collections.abc import Callable

import jax

# 'none' (no jax.checkpoint) keeps every residual autodiff wants, cheap elementwise ones included (the norms'
# rsqrt, silu's pieces, softmax scores and probabilities): on configs/tiny.yaml that is 26 stacked [layers, ...]
# buffers per device against 1 under 'full', 2.3x the temporaries and 16% more bytes moved per step (compiled
# figures, XLA:CPU). A small model is bound by memory traffic, not FLOPs, which is why 'none' ran ~6% slower
# than 'full' there; 'save_matmuls' keeps none's FLOPs at close to full's bytes.
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

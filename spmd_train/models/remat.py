"""Rematerialisation policies for the scanned layer, by name (`parallel.remat`)."""

from __future__ import annotations

from collections.abc import Callable

import jax

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

"""Rematerialisation policies for the scanned layer, by name (`parallel.remat`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
from jax.ad_checkpoint import checkpoint_name

from spmd_train.config.mesh_schema import REMAT_NAMES, ParallelConfig

# 'none' (no jax.checkpoint) keeps every residual autodiff wants, cheap elementwise ones included (the norms'
# rsqrt, silu's pieces, softmax scores and probabilities): on configs/tiny.yaml that is 26 stacked [layers, ...]
# buffers per device against 1 under 'full', 2.3x the temporaries and 16% more bytes moved per step. A small
# model is bound by memory traffic, not FLOPs, so 'none' steps 6-14% slower than 'full' there although it
# compiles 16% fewer FLOPs; 'save_matmuls' (9 buffers, the matmul outputs) keeps none's FLOPs at 2% over full's
# bytes and steps within 1% of 'full' (benchmarks/remat.py; docs/benchmarks.md, section remat). The cause is
# XLA keeping what autodiff saves, not our layer, so the default stays 'none' (no recompute, which large
# models on accelerators, compute-bound, gain from) and the choice is the user's.
LAYER_INPUT = "layer_input"
"""The name (`jax.ad_checkpoint.checkpoint_name`) of each scanned layer's input, the residual stream entering it."""
assert LAYER_INPUT in REMAT_NAMES


@dataclass(frozen=True)
class NamedRemat:
    """parallel.remat=names: the named intermediates (`config.mesh_schema.REMAT_NAMES`) kept on the device and in
    pinned host memory; everything else in the layer is recomputed in its backward pass."""

    save: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()


Remat = str | NamedRemat
"""A policy by name (`POLICIES`, or "none") or a names-based one."""


def remat_of(par: ParallelConfig) -> Remat:
    """The policy the layers run under for this `parallel` section."""
    return NamedRemat(par.remat_save, par.remat_offload) if par.remat == "names" else par.remat


def name(x: jax.Array, what: str) -> jax.Array:
    """`x` named `what` (one of `REMAT_NAMES`) for parallel.remat=names (a no-op otherwise)."""
    assert what in REMAT_NAMES, what
    return checkpoint_name(x, what)

POLICIES: dict[str, Callable | None] = {
    "full": None,  # save nothing: recompute the whole layer in the backward pass
    "save_matmuls": jax.checkpoint_policies.dots_saveable,
    "save_matmuls_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # full's recompute, with the one thing it keeps, each layer's input, in pinned host memory: sent there as the
    # forward pass makes it, fetched back for the layer's backward (MaxText's decoder_layer_input offload).
    "offload_layer_inputs": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[LAYER_INPUT], offload_src="device",
        offload_dst="pinned_host"),
}


def name_layer_input(x: jax.Array) -> jax.Array:
    """`x` named as a layer's input, which `offload_layer_inputs` keeps in host memory (a no-op otherwise)."""
    return name(x, LAYER_INPUT)


def apply_remat(fn: Callable, policy: Remat) -> Callable:
    """Wrap a layer function in jax.checkpoint with the policy ('none' returns fn as is)."""
    if isinstance(policy, NamedRemat):
        chosen = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=list(policy.save), names_which_can_be_offloaded=list(policy.offload),
            offload_src="device", offload_dst="pinned_host")
        return jax.checkpoint(fn, policy=chosen, prevent_cse=False)
    if policy == "none":
        return fn
    if policy not in POLICIES:
        raise ValueError(f"parallel.remat={policy!r} is not a policy (valid: none, names, {', '.join(POLICIES)})")
    return jax.checkpoint(fn, policy=POLICIES[policy], prevent_cse=False)

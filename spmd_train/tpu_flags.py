"""The libtpu compiler flags every spmd_train process runs with (LIBTPU_INIT_ARGS, read once when libtpu loads).

Without them libtpu rewrites the collectives ZeRO-3 is built from into all-reduces whenever the device
group spans more than one dimension of the torus (every fsdp axis larger than one ring: 16 chips of a
v5e/v6e, 64 of a v5p), so each weight gather and gradient reduce-scatter moves twice the bytes:

- an all-gather becomes an all-reduce of a zero-padded full buffer unless async all-gathers are preferred
  (`xla_tpu_prefer_async_allgather_to_allreduce` with async all-gathers enabled);
- a reduce-scatter over such a group is split by the reduce-scatter decomposer into all-reduce + slice
  unless reduce-scatters may run on the SparseCores, N-dimensional ones
  (`xla_tpu_enable_sparse_core_collective_offload_nd_reduce_scatter`) and the rest
  (`xla_tpu_enable_sparse_core_collective_offload_reduce_scatter`: without it a gradient scattered on a
  dimension the layout does not put first, such as a down projection's or an attention weight's model
  dimension, still becomes an all-reduce on a v6e 4x4 or among the strided fsdp groups of fsdp x expert
  on a v5p 4x4x4). Chips without SparseCores (v5e) compile the same collectives with them set.

These are the settings large TPU recipes (MaxText's among them) run with. A flag the user already put in
LIBTPU_INIT_ARGS keeps the user's value; `SPMD_TRAIN_TPU_FLAGS=0` leaves the variable untouched.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

TPU_FLAGS: dict[str, str] = {
    "xla_tpu_prefer_async_allgather_to_allreduce": "true",
    "xla_enable_async_all_gather": "true",
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather": "true",
    "xla_tpu_enable_sparse_core_collective_offload_nd_reduce_scatter": "true",
    "xla_tpu_enable_sparse_core_collective_offload_reduce_scatter": "true",
}
"""Flag name -> value that spmd_train adds to LIBTPU_INIT_ARGS (see the module docstring for why)."""

OPT_OUT = "SPMD_TRAIN_TPU_FLAGS"


def parse_init_args(args: str) -> dict[str, str]:
    """`--name=value` (or bare `--name`, meaning true) words of a LIBTPU_INIT_ARGS string, by name."""
    flags = {}
    for word in args.split():
        name, _, value = word.lstrip("-").partition("=")
        if name:
            flags[name] = value or "true"
    return flags


def merged_init_args(existing: str) -> str:
    """`existing` LIBTPU_INIT_ARGS with every TPU_FLAGS entry it does not already set appended."""
    have = parse_init_args(existing)
    added = [f"--{name}={value}" for name, value in TPU_FLAGS.items() if name not in have]
    return " ".join([existing.strip(), *added]).strip()


def apply_tpu_flags(environ: MutableMapping[str, str] = os.environ) -> None:
    """Put TPU_FLAGS into LIBTPU_INIT_ARGS; only effective before libtpu loads (first TPU device or topology)."""
    if environ.get(OPT_OUT, "1").strip().lower() in ("0", "false", "no", "off"):
        return
    environ["LIBTPU_INIT_ARGS"] = merged_init_args(environ.get("LIBTPU_INIT_ARGS", ""))


def tpu_flags_in_effect(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """The flags of TPU_FLAGS as LIBTPU_INIT_ARGS sets them now (absent: libtpu's default)."""
    have = parse_init_args(environ.get("LIBTPU_INIT_ARGS", ""))
    return {name: have[name] for name in TPU_FLAGS if name in have}

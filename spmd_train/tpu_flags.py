"""The libtpu compiler flags every spmd_train process runs with (LIBTPU_INIT_ARGS, read once when libtpu loads).

Without them libtpu turns ZeRO-3's all-gathers and reduce-scatters over groups spanning more than one torus
dimension into all-reduces, twice the bytes. A flag the user already put in LIBTPU_INIT_ARGS keeps the user's
value; `SPMD_TRAIN_TPU_FLAGS=0` leaves the variable untouched.

Details: docs/describe.md#zero-3-on-large-slices-the-tpu-flags-and-the-zero-floor
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

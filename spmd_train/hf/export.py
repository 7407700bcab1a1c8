"""Export: our parameters as a Hugging Face checkpoint (size-capped safetensors shards, an index, config.json).

Tensors are gathered one at a time, in file order, and each shard file is written once its tensors are
together, so a host holds at most one shard file's worth (`max_shard_bytes`). Everything is written into
a temporary directory beside the target and renamed into place at the end: an interrupted export
leaves no half-written checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import ml_dtypes  # noqa: F401  (bfloat16 for numpy)
import numpy as np
from flax import traverse_util
from jax.experimental import multihost_utils
from safetensors.numpy import save_file

from spmd_train.config.families import family_named
from spmd_train.config.hf_config import hf_config
from spmd_train.errors import ConfigError
from spmd_train.hf.files import INDEX
from spmd_train.hf.names import Piece, pieces, stored_index
from spmd_train.output_dir import make_output_dir

DEFAULT_SHARD_BYTES = 2 * 2**30
"""Largest safetensors file written (a tensor larger than this gets a file of its own)."""
EXPORT_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Exported:
    """What an export wrote."""

    directory: Path
    files: tuple[str, ...]
    tensors: int
    total_bytes: int
    mtp_layers: tuple[int, ...] = ()
    """The layer numbers model.mtp's modules were written as (none: left out)."""


def export_hf(engine, params: Any, directory: str | Path, *, base_config: Mapping[str, Any] | None = None,
              dtype: str = "bfloat16", max_shard_bytes: int = DEFAULT_SHARD_BYTES, drop_mtp: bool = False
              ) -> Exported:
    """Write `params` (stored layout, `engine`'s shardings) to `directory` as a Hugging Face checkpoint.

    `base_config`: the config.json the model was imported from (its other fields are kept). model.mtp's modules are
    written where the family's checkpoints hold them (DeepSeek-V3), unless `drop_mtp`.
    """
    directory = Path(directory)
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"export dtype {dtype!r} is not one of: {', '.join(EXPORT_DTYPES)}")
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ConfigError(f"{directory} already exists and is not an empty directory (valid: a new directory; "
                          "nothing was written)")
    model = engine.cfg.model
    if drop_mtp:
        model = dataclasses.replace(model, mtp=None)
    config = hf_config(model, base_config, dtype=dtype)
    plan: dict[str, list[Piece]] = {}  # each tensor's pieces: two for a fused one (gpt-oss's gate_up_proj)
    for piece in pieces(model, family_named(config["model_type"])):
        plan.setdefault(piece.hf_name, []).append(piece)
    flat = traverse_util.flatten_dict(params, sep=".")
    row = engine.stored_row_of_model  # the stored row of each model row (stack order and padding may differ)
    np_dtype = np.dtype(dtype)
    tensor_names = list(plan)
    sizes = [math.prod(p.layout.hf_shape(tuple(flat[p.path].shape[len(p.index):]))) * np_dtype.itemsize
             for p in (plan[name][0] for name in tensor_names)]
    groups = _pack(sizes, max_shard_bytes)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))])
    writer = jax.process_index() == 0
    if writer:  # before the staging directory beside the target: `--to exported/qwen3` with no exported/ yet
        make_output_dir(directory.parent, f"{directory}'s parent directory {directory.parent}")
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent)) if writer else None
    try:
        weight_map = {}
        for name, members in zip(names, groups, strict=True):
            tensors = {}
            for k in members:
                hf_name, tensor = tensor_names[k], None
                for p in plan[hf_name]:
                    index = stored_index(p, row)
                    value = _gather(flat[p.path][index] if index else flat[p.path])
                    tensor = p.layout.into_hf(value.astype(np_dtype), tensor)
                tensors[hf_name] = tensor
                weight_map[hf_name] = name
            if writer:
                save_file(tensors, str(staging / name), metadata={"format": "pt"})
            del tensors
        if writer:
            if len(groups) > 1:
                index_json = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
                (staging / INDEX).write_text(json.dumps(index_json, indent=2) + "\n")
            (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            _default_permissions(staging)
            if directory.exists():
                directory.rmdir()
            staging.rename(directory)
    except BaseException:
        if writer and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
        raise
    written = model.mtp is not None and family_named(config["model_type"]).tensors.mtp
    layers = tuple(range(model.num_layers, model.num_layers + model.mtp.depth)) if written else ()
    return Exported(directory, tuple(names), len(tensor_names), sum(sizes), layers)


def _default_permissions(directory: Path) -> None:
    # mkdtemp makes the directory private and safetensors writes 0600 files: give them what a plain mkdir and
    # open would (the umask's), so the checkpoint can be shared like any other output.
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def _pack(sizes: list[int], cap: int) -> list[list[int]]:
    """Consecutive tensors grouped into files of at most `cap` bytes (a larger tensor alone)."""
    groups: list[list[int]] = [[]]
    used = 0
    for k, size in enumerate(sizes):
        if groups[-1] and used + size > cap:
            groups.append([])
            used = 0
        groups[-1].append(k)
        used += size
    return groups


def _gather(x: jax.Array) -> np.ndarray:
    """One array, whole, on this host (across processes when the mesh spans several)."""
    if jax.process_count() > 1:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))

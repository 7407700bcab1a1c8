"""Import: stream a Hugging Face checkpoint tensor by tensor into our parameters, already sharded on the mesh.

Each parameter starts as zeros in its own sharding; each Hugging Face tensor is read from disk alone,
laid out as our slice (a numpy view: transposes and head splits copy nothing), cut into the shards this
process's devices hold (cast to the parameter dtype shard by shard) and written into its layer/expert
slot on the devices. A host holds at most one stored tensor plus one device's shard of it at a time,
besides what its devices hold; nothing gathers the model anywhere.
"""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd_train.config.hf_config import family, read_hf_config
from spmd_train.errors import ConfigError
from spmd_train.hf.files import SafetensorsDir
from spmd_train.hf.names import IGNORED_SUFFIXES, pieces, stored_index

log = logging.getLogger("spmd_train")


def load_hf_params(engine, directory: str | Path) -> Any:
    """Our parameters (a pure dict in `engine`'s shardings, its stored layer order) from a checkpoint directory.

    ConfigError before anything is read when a tensor is missing, unexpected, or of another shape.
    """
    directory = Path(directory)
    config = read_hf_config(directory)
    fam = family(config)
    files = SafetensorsDir(directory)
    model = engine.cfg.model
    prefixes = fam.unread(config, model)
    unread = [name for name in files.shapes if name.startswith(prefixes)] if prefixes else []
    if unread:
        log.info("leaving %d tensors of %s unread (%s)", len(unread), directory, ", ".join(prefixes))
        for name in unread:
            del files.shapes[name]
    plan = list(pieces(model, fam))
    shapes = traverse_util.flatten_dict(engine.param_shapes, sep=".")
    shardings = traverse_util.flatten_dict(engine.state_shardings.params, sep=".")
    _check(plan, files, shapes, directory, fam.tensors.lm_head)
    row = engine.stored_row_of_model  # the stored row of each model row (stack order and padding may differ)
    params: dict[str, jax.Array] = {}
    for path, struct in shapes.items():
        params[path] = _zeros(struct.shape, struct.dtype, shardings[path])
    if model.mtp is not None and not fam.tensors.mtp:
        log.info("%s holds no multi-token prediction modules: model.mtp's %d start fresh (train.seed)", directory,
                 model.mtp.depth)
        params |= _fresh_mtp(engine, shardings)
    for piece in plan:
        if piece.copy:  # the trunk's own tensor fills the parameter
            continue
        struct, sharding = shapes[piece.path], shardings[piece.path]
        index = stored_index(piece, row)
        ours = tuple(struct.shape[len(index):])
        host = piece.layout.to_ours(files.tensor(piece.hf_name), ours)
        part = NamedSharding(sharding.mesh, P(*_spec(sharding, struct.ndim)[len(index):]))
        value = jax.make_array_from_callback(ours, part, functools.partial(_shard, host, struct.dtype))
        params[piece.path] = _place(params[piece.path], value, index) if index else value
        del host
    log.info("imported %d tensors from %s", len({p.hf_name for p in plan}), directory)
    return traverse_util.unflatten_dict(params, sep=".")


def _check(plan, files: SafetensorsDir, shapes: dict, directory: Path, lm_head: str) -> None:
    wanted = {p.hf_name for p in plan}
    missing = [p.hf_name for p in plan if p.hf_name not in files.shapes]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ConfigError(f"{directory} lacks {len(missing)} tensor(s) the model needs: {', '.join(missing[:5])}{more}"
                          f" (does config.json describe these weights?)")
    extra = sorted(k for k in files.shapes if k not in wanted and not k.endswith(IGNORED_SUFFIXES))
    tied_copy = [k for k in extra if k == lm_head]  # some tied checkpoints also save the shared table
    extra = [k for k in extra if k not in tied_copy]
    if extra:
        kinds = " and ".join(sorted(_families(plan)))
        raise ConfigError(f"{directory} holds {len(extra)} tensor(s) this architecture has no place for: "
                          f"{', '.join(_collapse(extra)[:6])} (valid: the tensors of the {kinds} model its "
                          "config.json describes)")
    for p in plan:
        struct = shapes[p.path]
        expected = p.layout.hf_shape(tuple(struct.shape[len(p.index):]))
        if files.shapes[p.hf_name] != expected:
            raise ConfigError(f"{p.hf_name} has shape {list(files.shapes[p.hf_name])} in {directory}, and the model "
                              f"configured needs {list(expected)} (for our {p.path} {list(struct.shape)}; check "
                              "config.json and any model.* overrides)")


def _families(plan) -> set[str]:
    return {"MoE" if len(p.index) > 1 or p.path.endswith("mlp.router") else "dense" for p in plan if p.index}


def _fresh_mtp(engine, shardings: dict[str, NamedSharding]) -> dict[str, jax.Array]:
    """model.mtp's modules drawn as a new model's are (each device computing its own shards), by dotted path."""
    from spmd_train.models.mtp import MTP
    from spmd_train.models.transformer import Block

    cfg = engine.cfg
    out = traverse_util.unflatten_dict({k[len("mtp."):]: v for k, v in shardings.items() if k.startswith("mtp.")},
                                       sep=".")
    # A stream of their own: the seed's first draws are the trunk's embedding's.
    init = jax.jit(lambda: nnx.to_pure_dict(nnx.state(MTP(cfg.model, nnx.Rngs(cfg.train.seed + 1), engine.backends,
                                                          Block))), out_shardings=out)
    return {f"mtp.{k}": v for k, v in traverse_util.flatten_dict(init(), sep=".").items()}


def _collapse(names: list[str]) -> list[str]:
    """Tensor names with layer and expert numbers folded: model.layers.{i}.mlp.gate_proj.weight."""
    return list(dict.fromkeys(re.sub(r"\.(\d+)\.", ".{i}.", n) for n in names))


def _spec(sharding: NamedSharding, ndim: int) -> tuple:
    spec = tuple(sharding.spec)
    return spec + (None,) * (ndim - len(spec))


def _shard(host: np.ndarray, dtype, index: tuple) -> np.ndarray:
    # One device's shard, cast on its own: the whole tensor is never converted at once.
    return np.asarray(host[index], dtype=dtype)


@functools.cache
def _zeros_fn(shape: tuple[int, ...], dtype, sharding: NamedSharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def _zeros(shape, dtype, sharding) -> jax.Array:
    return _zeros_fn(tuple(shape), jnp.dtype(dtype), sharding)()


@functools.cache
def _update_fn(sharding: NamedSharding):
    def update(full: jax.Array, value: jax.Array, index: jax.Array) -> jax.Array:
        start = (*[index[i] for i in range(index.shape[0])], *([0] * value.ndim))
        return jax.lax.dynamic_update_slice(full, value[(None,) * index.shape[0]], start)

    return jax.jit(update, donate_argnums=0, out_shardings=sharding)


def _place(full: jax.Array, value: jax.Array, index: tuple[int, ...]) -> jax.Array:
    # The slot is an argument, not a constant: one compiled update serves every layer (and expert).
    return _update_fn(full.sharding)(full, value, np.asarray(index, np.int32))

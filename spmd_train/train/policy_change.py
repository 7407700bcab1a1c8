"""Resuming under another precision policy: a checkpoint's optimizer state read as it was saved, then carried over.

A run may change `precision.master`, `precision.loss_scale` and `precision.moments` when it resumes (the model and
the optimizer stay the same): the state is restored in the saved policy's structure (so its fingerprint still
checks), then the moments are cast to this run's dtype, a master copy is dropped (the stored parameters are its
rounding already) or added (from the stored parameters, exactly as the first step would see them), and a loss scale
is dropped or added (at precision.loss_scale_init).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp

from spmd_train.config.precision_schema import PrecisionConfig, moment_dtype
from spmd_train.config.schema import Config
from spmd_train.train.loss_scale import LossScaleState
from spmd_train.train.master_weights import MasterState, to_f32
from spmd_train.train.optimizer import make_optimizer, opt_state_shardings

log = logging.getLogger("spmd_train")

STATE_KEYS = ("master", "loss_scale", "moments")
"""The precision settings that shape the optimizer state."""


def saved_precision(meta: dict, cfg: Config) -> PrecisionConfig:
    """The precision policy a checkpoint was saved under (keys it predates: their defaults), this run's otherwise."""
    saved = meta.get("config", {}).get("precision", {})
    return dataclasses.replace(cfg.precision, master=saved.get("master", "none"),
                               loss_scale=saved.get("loss_scale", "none"), moments=saved.get("moments"),
                               loss_scale_init=saved.get("loss_scale_init", cfg.precision.loss_scale_init))


def changes(meta: dict, cfg: Config) -> list[str]:
    """What differs between the checkpoint's policy and this run's, as 'key: saved -> now' (empty: nothing)."""
    old, new = saved_precision(meta, cfg), cfg.precision
    param_dtype = cfg.model.param_dtype
    found = [f"precision.{k}: {getattr(old, k)} -> {getattr(new, k)}" for k in ("master", "loss_scale")
             if getattr(old, k) != getattr(new, k)]
    before, after = moment_dtype(old.moments, old.master, param_dtype), moment_dtype(new.moments, new.master,
                                                                                     param_dtype)
    if before != after:
        found.append(f"moments: {before} -> {after}")
    return found


def saved_opt_target(engine: Any, meta: dict) -> Any:
    """The abstract optimizer state, with this mesh's shardings, of the checkpoint's policy."""
    cfg = engine.cfg
    tx = make_optimizer(cfg.optim, cfg.train.steps, engine.logical, saved_precision(meta, cfg))
    shapes = jax.eval_shape(tx.init, engine.param_shapes)
    shardings = opt_state_shardings(tx, shapes, engine.layout, engine.logical, engine.param_shapes)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def carry_over(engine: Any, state: Any, meta: dict) -> Any:
    """`state`, restored under the checkpoint's policy, under this run's (see the module's docstring)."""
    cfg = engine.cfg
    log.info("resuming under another precision policy (%s)", "; ".join(changes(meta, cfg)))
    scale, master, opt = _unwrap(state.opt_state)
    *_, inner = _unwrap(engine.abstract_state().opt_state)
    opt = jax.tree.map(lambda x, t: x.astype(t.dtype), opt, inner)  # the same optimizer: the same tree
    if cfg.precision.master == "float32":
        opt = MasterState(to_f32(state.params) if master is None else master, opt)
    if cfg.precision.loss_scale == "dynamic":
        fresh = (jnp.asarray(cfg.precision.loss_scale_init, jnp.float32), jnp.zeros((), jnp.int32))
        opt = LossScaleState(*((scale.scale, scale.good_steps) if scale is not None else fresh), opt)
    opt = jax.device_put(opt, engine.state_shardings.opt_state)
    return state._replace(opt_state=opt)


def _unwrap(opt: Any) -> tuple[LossScaleState | None, Any, Any]:
    """(the loss scale's state or None, the master copy or None, the optimizer's own state) of an optimizer state."""
    scale = opt if isinstance(opt, LossScaleState) else None
    opt = opt.inner if scale is not None else opt
    master = opt.master if isinstance(opt, MasterState) else None
    return scale, master, opt.inner if isinstance(opt, MasterState) else opt


"""AdamW with linear warmup, cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import PartitionSpec as P

from spmd_train.config.schema import OptimConfig
from spmd_train.models.layers import STACKING_AXES


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Learning rate at optimizer step t (0-based): linear warmup to `lr`, cosine down to lr * min_lr_ratio."""
    end = cfg.lr * cfg.min_lr_ratio
    if cfg.warmup_steps == 0:
        return optax.cosine_decay_schedule(cfg.lr, max(total_steps, 1), alpha=cfg.min_lr_ratio)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(total_steps, cfg.warmup_steps + 1),
        end_value=end,
    )


def decay_mask(logical_tree: Any) -> Any:
    """Weight decay applies to matrices only: norm scales (one axis besides the stacking axes) are exempt."""
    return jax.tree.map(
        lambda spec: sum(1 for name in spec if name not in STACKING_AXES) >= 2, logical_tree,
        is_leaf=lambda x: isinstance(x, P),
    )


def make_optimizer(cfg: OptimConfig, total_steps: int, logical_tree: Any) -> optax.GradientTransformation:
    """The optimizer for a model whose parameters have these logical axes."""
    return optax.chain(
        # identity() has clipping's (empty) state: a checkpoint resumes with clipping on or off.
        optax.clip_by_global_norm(cfg.clip_norm) if cfg.clip_norm is not None else optax.identity(),
        optax.adamw(
            lr_schedule(cfg, total_steps),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=decay_mask(logical_tree),
        ),
    )

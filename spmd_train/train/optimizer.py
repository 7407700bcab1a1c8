"""The optimizer (`train.optimizers`: AdamW, Adafactor or Lion) with a warmup-then-decay learning rate and
global-norm clipping (optax).

Schedules are functions of the optimizer's count t of applied steps (0-based: the first update uses lr(0)).
Below W = optim.warmup_steps, T = train.steps, lr = optim.lr and lr_min = lr * optim.min_lr_ratio. Every
schedule starts with the same linear warmup, lr * t / W for t < W (none when W = 0); the formulas in the
schedule functions' docstrings hold for t >= W. optax schedules hold their last value after T.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd_train.config.optimizer_facts import MOMENT_KEYS, is_matrix, optimizer_facts
from spmd_train.config.precision_schema import PrecisionConfig
from spmd_train.config.train_schema import OptimConfig
from spmd_train.errors import ConfigError
from spmd_train.sharding.layout import Layout
from spmd_train.train.loss_scale import with_loss_scale
from spmd_train.train.master_weights import with_master_copy
from spmd_train.train.moment_dtype import with_moment_dtype
from spmd_train.train.optimizers import optimizer_named


def _decay_steps(cfg: OptimConfig, total: int) -> int:
    """T - W: the steps after warmup (at least 1, so a schedule never divides by zero)."""
    return max(total - cfg.warmup_steps, 1)


def cosine(cfg: OptimConfig, total: int) -> optax.Schedule:
    """lr_min + (lr - lr_min) * (1 + cos(pi * (t - W) / (T - W))) / 2."""
    return optax.cosine_decay_schedule(cfg.lr, _decay_steps(cfg, total), alpha=cfg.min_lr_ratio)


def linear(cfg: OptimConfig, total: int) -> optax.Schedule:
    """lr - (lr - lr_min) * (t - W) / (T - W)."""
    return optax.linear_schedule(cfg.lr, cfg.lr * cfg.min_lr_ratio, _decay_steps(cfg, total))


def constant(cfg: OptimConfig, total: int) -> optax.Schedule:
    """lr (min_lr_ratio plays no part)."""
    return optax.constant_schedule(cfg.lr)


def wsd(cfg: OptimConfig, total: int) -> optax.Schedule:
    """Warmup-stable-decay: lr until S = max(T - D, W), D = round(decay_fraction * T), then linear,
    lr - (lr - lr_min) * (t - S) / (T - S), reaching lr_min at T.

    The decay ("cooldown") is linear as in Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training
    Beyond Fixed Training Durations" (arXiv:2405.18392), who decay the last ~20% of training; MiniCPM
    (Hu et al. 2024, arXiv:2404.06395), which named WSD, decays exponentially instead.
    """
    stable = max(total - round(cfg.decay_fraction * total) - cfg.warmup_steps, 0)  # steps at lr after warmup
    decay = optax.linear_schedule(cfg.lr, cfg.lr * cfg.min_lr_ratio, max(total - cfg.warmup_steps - stable, 1))
    return optax.join_schedules([optax.constant_schedule(cfg.lr), decay], [stable])


def inverse_sqrt(cfg: OptimConfig, total: int) -> optax.Schedule:
    """max(lr * sqrt(V / max(t, V)), lr_min) with V = max(W, 1); T plays no part.

    The floor keeps min_lr_ratio meaning "the lowest learning rate" for every schedule (0: none).
    """
    scale = max(cfg.warmup_steps, 1)
    # optax hands the schedule the steps after warmup, s = t - W.
    return lambda s: jnp.maximum(cfg.lr * jnp.sqrt(scale / jnp.maximum(s + cfg.warmup_steps, scale)),
                                 cfg.lr * cfg.min_lr_ratio)


SCHEDULES: dict[str, Callable[[OptimConfig, int], optax.Schedule]] = {
    "cosine": cosine, "wsd": wsd, "linear": linear, "constant": constant, "inverse_sqrt": inverse_sqrt}


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Learning rate at optimizer step t (0-based): linear warmup to `lr`, then `cfg.schedule`."""
    after = SCHEDULES[cfg.schedule](cfg, total_steps)
    if cfg.warmup_steps == 0:
        return after
    warmup = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
    return optax.join_schedules([warmup, after], [cfg.warmup_steps])


def hyperparameters(cfg: OptimConfig) -> dict[str, float | None]:
    """b1/b2/eps for `cfg.name`: as set, else the optimizer's default; a value set where none applies is refused
    (`config.optimizer_facts.OptimizerFacts.defaults` and `not_applicable`)."""
    facts = optimizer_facts(cfg.name)
    defaults, why = dict(facts.defaults), dict(facts.not_applicable)
    out = {}
    for key in MOMENT_KEYS:
        value = getattr(cfg, key)
        if key in defaults:
            out[key] = defaults[key] if value is None else value
        elif value is not None:  # ignoring it would run something other than what the user asked for
            raise ConfigError(f"optim.{key}={value} does not apply to optim.name={cfg.name}: "
                              f"{why[key]} (valid: optim.{key}=null)")
    return out


def decay_mask(logical_tree: Any) -> Any:
    """Weight decay applies to matrices only (`config.optimizer_facts.is_matrix`): norm scales, biases (Q/K/V's
    [heads, head_dim] included) and attention sinks are exempt."""
    return jax.tree.map(lambda spec: is_matrix(tuple(spec)), logical_tree, is_leaf=lambda x: isinstance(x, P))


def _core(cfg: OptimConfig, lr: optax.Schedule, logical_tree: Any) -> optax.GradientTransformation:
    """The optimizer itself (`train.optimizers`), with decoupled weight decay lr_t * weight_decay * p on the masked
    parameters."""
    return optimizer_named(cfg.name).build(cfg, lr, decay_mask(logical_tree), hyperparameters(cfg), logical_tree)


def make_optimizer(cfg: OptimConfig, total_steps: int, logical_tree: Any, precision: PrecisionConfig | None = None,
                   *, clip: bool = True) -> optax.GradientTransformation:
    """The optimizer for a model whose parameters have these logical axes, under the `precision` policy: its moments
    in precision.moments (`train.moment_dtype`), on a float32 master copy of them (precision.master=float32,
    `train.master_weights`), with a dynamic loss scale in its state (precision.loss_scale=dynamic,
    `train.loss_scale`). `clip=False`: no clipping in the chain (the same state), for a caller that clipped the whole
    gradient first (`train.offload`, whose slices would each be clipped by their own norm)."""
    precision = precision or PrecisionConfig()
    core = _core(cfg, lr_schedule(cfg, total_steps), logical_tree)
    if precision.moments is not None:
        core = with_moment_dtype(core, precision.moments)
    tx = optax.chain(
        # identity() has clipping's (empty) state: a checkpoint resumes with clipping on or off.
        optax.clip_by_global_norm(cfg.clip_norm) if cfg.clip_norm is not None and clip else optax.identity(),
        core,
    )
    tx = with_master_copy(tx) if precision.master == "float32" else tx
    return with_loss_scale(tx, precision.loss_scale_init) if precision.loss_scale == "dynamic" else tx


def state_sharding(leaf: Any, param_sharding: NamedSharding, param: Any) -> NamedSharding:
    """Sharding of an optimizer-state leaf kept for one parameter: the parameter's where the shapes agree, the
    parameter's less one axis for a factored moment (Adafactor's row or column RMS), else replicated; a parameter
    another part of the optimizer holds (`optax.partition`'s `MaskedNode`) stays masked."""
    if isinstance(leaf, optax.MaskedNode):
        return leaf
    if leaf.shape == param.shape:
        return param_sharding
    spec = (*param_sharding.spec, *(None,) * (len(param.shape) - len(param_sharding.spec)))
    # The reduced axis is not recorded; of two of the same size either gives a valid (equally sized) layout.
    for axis in reversed(range(len(param.shape))):
        if leaf.shape == param.shape[:axis] + param.shape[axis + 1:]:
            return NamedSharding(param_sharding.mesh, P(*spec[:axis], *spec[axis + 1:]))
    return NamedSharding(param_sharding.mesh, P())  # Adafactor's (1,) placeholders


def state_differences(saved: dict, cfg: OptimConfig) -> list[str]:
    """The settings that shape the optimizer state and differ between a checkpoint's `optim` record and `cfg`."""
    name = saved.get("name", "adamw")  # checkpoints from before optim.name were AdamW's
    if name != cfg.name:
        return [f"optim.name: checkpoint {name!r}, this run {cfg.name!r}"]
    if optimizer_facts(name).b1_adds_state and (saved.get("b1") is None) != (cfg.b1 is None):
        return [f"optim.b1: checkpoint {saved.get('b1')}, this run {cfg.b1} ({name} keeps a momentum "
                "only when optim.b1 is set)"]
    return []


def opt_state_shardings(tx: optax.GradientTransformation, opt_shapes: Any, layout: Layout, logical_tree: Any,
                        param_shapes: Any) -> Any:
    """The shardings of `tx`'s state (shapes `opt_shapes`) for parameters of these shapes and logical axes: each
    parameter's state as `state_sharding` fits it, every other leaf (step counts, the loss scale) replicated."""
    return optax.tree_map_params(
        tx,
        state_sharding,
        opt_shapes,
        layout.opt_shardings(logical_tree, param_shapes),
        param_shapes,
        transform_non_params=lambda _: NamedSharding(layout.mesh, P()),
        is_leaf=lambda x: isinstance(x, optax.MaskedNode),  # another part's parameter (Muon's AdamW part)
    )


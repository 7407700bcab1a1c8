"""Step guards: a non-finite or spiking step is not applied, decided on device inside the jitted step.

A rejected step keeps the old parameters and optimizer state (`jnp.where`: no host round trip, no
recompilation), bitwise the step never taken; the batch is consumed. A spike is judged against the last
`train.spike_window` accepted steps: value > mean + `train.spike_sigma` x max(std, 1% of |mean|).

Details: docs/reliability.md#step-guards-inside-the-jitted-step
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from spmd_train.config.train_schema import TrainConfig
from spmd_train.train.loss_scale import MIN_SCALE

REASONS = (None, "nonfinite", "spike", "overflow")
"""skip_reason by the code the step reports (0: applied). "overflow": under a dynamic loss scale, a finite loss whose
scaled gradients overflowed while the scale could still fall (it halves: `precision.loss_scale`). Not a divergence:
`train.on_nonfinite=halt` lets it pass and it does not count toward `train.max_consecutive_skips` (the scale reaches
1 within log2(scale) of them; an overflow at 1 is the model's own, "nonfinite")."""
OVERFLOW = REASONS.index("overflow")
STD_FLOOR = 0.01
"""The smallest standard deviation a spike is measured in, as a share of the window's mean."""


class GuardState(NamedTuple):
    """What the guards carry from step to step (saved with the checkpoint, so a resume judges alike)."""

    window: jax.Array
    """[spike_window, 2] float32: loss and gradient norm of the latest accepted steps (a ring buffer)."""
    accepted: jax.Array
    """Accepted steps so far (int32); the next accepted step is written at accepted % spike_window."""
    consecutive: jax.Array
    """Steps skipped in a row (int32)."""
    skipped: jax.Array
    """Steps skipped in the whole run (int32)."""


def init_guard(cfg: TrainConfig) -> GuardState:
    """The guards of a run that has taken no step."""
    zero = jnp.zeros((), jnp.int32)
    return GuardState(jnp.zeros((cfg.spike_window, 2), jnp.float32), zero, zero, zero)


def judge(guard: GuardState, loss: jax.Array, grad_norm: jax.Array, cfg: TrainConfig,
          lr_finite: jax.Array | bool = True, loss_scale: jax.Array | None = None) -> jax.Array:
    """The step's skip reason code (an index into REASONS): 0 applied, 1 non-finite, 2 spike, 3 overflow.

    Non-finite: the loss, the gradient norm, or the learning rate (`lr_finite`: a NaN rate
    turns finite gradients into a NaN update). `loss_scale` (a dynamic loss scale's value): a finite loss with
    non-finite gradients is an overflow of the scale while it is above its floor, not a fault of the model.
    """
    values = jnp.stack([loss, grad_norm]).astype(jnp.float32)
    finite = jnp.all(jnp.isfinite(values)) & lr_finite
    spike = jnp.zeros((), bool)
    if cfg.spike_sigma is not None:
        mean = jnp.mean(guard.window, axis=0)
        std = jnp.maximum(jnp.std(guard.window, axis=0), STD_FLOOR * jnp.abs(mean))
        full = guard.accepted >= cfg.spike_window
        spike = full & jnp.any(values > mean + cfg.spike_sigma * std)
    code = jnp.where(finite, jnp.where(spike, 2, 0), 1)
    if loss_scale is not None:
        overflow = jnp.isfinite(values[0]) & ~jnp.isfinite(values[1]) & lr_finite & (loss_scale > MIN_SCALE)
        code = jnp.where(overflow, OVERFLOW, code)
    return code.astype(jnp.int32)


def advance(guard: GuardState, reason: jax.Array, loss: jax.Array, grad_norm: jax.Array) -> GuardState:
    """The guards after a step judged `reason`: an accepted step enters the window, a skip is counted (an overflow of
    the loss scale in the run's total only)."""
    ok = reason == 0
    slot = guard.accepted % guard.window.shape[0]
    entry = jnp.stack([loss, grad_norm]).astype(jnp.float32)
    window = jnp.where(ok, guard.window.at[slot].set(entry), guard.window)
    one = jnp.ones((), jnp.int32)
    consecutive = jnp.where(ok, 0, jnp.where(reason == OVERFLOW, guard.consecutive, guard.consecutive + 1))
    return GuardState(window, guard.accepted + jnp.where(ok, one, 0), consecutive,
                      guard.skipped + jnp.where(ok, 0, one))


def resize_window(guard: GuardState, size: int) -> GuardState:
    """Saved guards for a run with another `train.spike_window`: the latest min(old, new) applied steps, kept.

    Host-side, at restore. The carried entries go to slots 0..n-1 and `accepted` becomes n, so
    judging starts again once the new window is full.
    """
    old = np.asarray(guard.window)
    accepted = int(guard.accepted)
    n = min(accepted, old.shape[0], size)
    window = np.zeros((size, 2), np.float32)
    window[:n] = [old[j % old.shape[0]] for j in range(accepted - n, accepted)]
    return guard._replace(window=jnp.asarray(window), accepted=jnp.asarray(n, jnp.int32))


def keep_if(ok: jax.Array, new: Any, old: Any) -> Any:
    """`new` where the step is accepted, else `old`, leaf by leaf (fuses into the optimizer's update)."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def all_finite(tree: Any) -> jax.Array:
    """Whether every floating-point value of a pytree is finite (one bool, computed where the arrays live)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.ones((), bool)


_SKIPPED_FOR = {"nonfinite": "a non-finite loss or gradient", "spike": "a spike"}
"""What a run of skips that halts ended on (an overflow of the loss scale does not count toward one)."""


def halt_reason(record: dict[str, Any], cfg: TrainConfig, saved: list[int]) -> str | None:
    """Why the run must stop after this finished step (one paragraph), or None to go on."""
    step = record["step"]
    keep = f"nothing was saved from it; the newest checkpoint is step {saved[-1]}" if saved else \
        "nothing was saved from it"
    if record["skip_reason"] == "nonfinite" and cfg.on_nonfinite == "halt":
        return (f"step {step}: the loss ({record['loss']}) or gradient norm ({record['grad_norm']}) is not "
                f"finite; stopped (train.on_nonfinite=halt, valid: skip to go on); {keep}")
    if record["consecutive_skips"] >= cfg.max_consecutive_skips:
        return (f"step {step}: {record['consecutive_skips']} steps in a row were skipped (the last for "
                f"{_SKIPPED_FOR[record['skip_reason']]}:"
                f" loss {record['loss']:.6g}, grad_norm {record['grad_norm']:.6g}); stopped "
                f"(train.max_consecutive_skips={cfg.max_consecutive_skips}); {keep}. A diverged run "
                "usually needs a lower optim.lr or a restart from an earlier checkpoint")
    return None

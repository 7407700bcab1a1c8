"""What a restored checkpoint is read into and whether it can be trusted: the pieces of `Trainer`'s one restore path."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import jax

from spmd_train.config.schema import Config
from spmd_train.errors import ConfigError
from spmd_train.train.checkpoint import Checkpointer, check_same_model, check_same_parameters
from spmd_train.train.engine import Engine, TrainState
from spmd_train.train.fingerprint import differences
from spmd_train.train.guards import resize_window
from spmd_train.train.policy_change import carry_over, changes, saved_opt_target


class Unguarded(NamedTuple):
    """The train state as checkpoint format 1 saved it (before the step guards)."""

    step: Any
    params: Any
    opt_state: Any


def restore_target(engine: Engine, cfg: Config, meta: dict) -> Any:
    """The abstract state a checkpoint with this meta is read into: its guards, and its optimizer state under its
    precision policy (`policy_change`), as they were saved."""
    target = engine.abstract_state()
    if changes(meta, cfg):
        target = target._replace(opt_state=saved_opt_target(engine, meta))
    if meta.get("format", 1) < 2:  # saved before the step guards existed
        return Unguarded(target.step, target.params, target.opt_state)
    saved = meta["config"]["train"]["spike_window"]
    if saved != cfg.train.spike_window:
        window = target.guard.window
        return target._replace(guard=target.guard._replace(
            window=jax.ShapeDtypeStruct((saved, 2), window.dtype, sharding=window.sharding)))
    return target


def damage(engine: Engine, state: Any, meta: dict, same_run: bool) -> str | None:
    """Why a restored state cannot be trusted (non-finite values, or values that differ from the fingerprint
    its save recorded), or None. Fingerprints compare only when resuming: load_from may cast dtypes."""
    finite, prints = jax.device_get(engine.state_health(state))
    if not finite:
        return "it holds non-finite parameters or optimizer state"
    if same_run and "fingerprint" in meta:
        changed = differences(meta["fingerprint"], prints, state)
        if changed:
            return f"{len(changed)} arrays differ from the fingerprint recorded when it was saved (first: {changed[0]})"
    return None


def with_guards(engine: Engine, cfg: Config, state: Any) -> TrainState:
    """A restored state with this run's step guards: fresh before format 2, resized for another window."""
    if isinstance(state, Unguarded):
        return TrainState(*state, guard=engine.fresh_guard())
    if state.guard.window.shape[0] != cfg.train.spike_window:
        guard = resize_window(state.guard, cfg.train.spike_window)
        return state._replace(guard=jax.device_put(guard, engine.state_shardings.guard))
    return state


def restore_latest(engine: Engine, cfg: Config, source: Checkpointer, where: Path, *, same_run: bool = True,
                   only: int | None = None) -> tuple[int, TrainState] | None:
    """The one restore path (resume, `restore()`, `load_from`): the latest restorable checkpoint of
    `source`, resharded onto this mesh, layers in this run's order. Resuming (`same_run`) needs the same
    model section; starting from another run's parameters needs only the same parameter shapes."""
    if same_run:
        check = lambda meta: check_same_model(meta, cfg, str(where))
    else:
        check = lambda meta: check_same_parameters(meta, cfg, engine.param_shapes, str(where))
    restored = source.restore_latest(lambda meta: restore_target(engine, cfg, meta), check,
                                     lambda state, meta: damage(engine, state, meta, same_run), only=only)
    if restored is None:
        return None
    step, state, meta = restored
    if same_run and changes(meta, cfg):
        state = carry_over(engine, state, meta)
    return step, engine.reorder_layers(with_guards(engine, cfg, state), meta.get("layer_order"))


def load_from_source(path: Path, given: str) -> tuple[Checkpointer, Path, int | None]:
    """(checkpoints to read, their run.dir, the one step asked for or None) for checkpoint.load_from=`given`:
    a run.dir (its latest checkpoint), its checkpoints/ or one checkpoints/STEP."""
    step = None
    if path.name.isdigit() and path.parent.name == "checkpoints":
        step, path = int(path.name), path.parent
    run_dir = path.parent if path.name == "checkpoints" else path
    if not (run_dir / "checkpoints").is_dir():
        raise ConfigError(f"checkpoint.load_from={given} holds no checkpoints directory "
                          "(valid: a run.dir, its checkpoints/ or a checkpoints/STEP directory)")
    source = Checkpointer(run_dir / "checkpoints", read_only=True)
    if not source.steps() or (step is not None and step not in source.steps()):
        raise ConfigError(f"checkpoint.load_from={given} holds no checkpoint"
                          + (f" at step {step}" if step is not None else "")
                          + f" (valid steps there: {source.steps() or 'none'})")
    return source, run_dir, step

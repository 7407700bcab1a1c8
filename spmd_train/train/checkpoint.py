"""Orbax checkpoints: async saves of the train state plus a JSON record of the run's layout.

Each checkpoint holds the state (`StandardSave`: no pickle) and `meta` (`JsonSave`): the
resolved config, the mesh, the sharding rules and the parameter shapes. Restoring reads the
meta first, so a different architecture is explained rather than crashing, while a
different mesh or ZeRO stage simply reshards (the abstract target carries the new shardings).
Orbax writes each step into a temporary directory and renames it when complete, so a save
cut short by a crash is never listed; a listed checkpoint that still fails to load, or whose
values differ from the fingerprint recorded at save (`train/fingerprint.py`), is skipped with
a warning in favour of the one before it and moved to `run.dir/damaged_checkpoints/`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from spmd_train.config.load import model_from_record
from spmd_train.config.schema import Config
from spmd_train.errors import CheckpointWriteError, ConfigError
from spmd_train.train.optimizer import state_differences

log = logging.getLogger("spmd_train")
FORMAT = 2
"""Checkpoint layout version: 2 adds the step guards to the state (format 1 restores without them)."""

class Checkpointer:
    """Save and restore train states under one directory (`run.dir/checkpoints`)."""

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True, read_only: bool = False):
        self.directory = Path(directory).absolute()
        self.read_only = read_only
        self.failed: str | None = None
        """Why a write failed (then every later save or wait raises it again)."""
        self._in_flight: int | None = None
        if read_only and not self.directory.is_dir():
            raise ConfigError(f"no checkpoint directory at {self.directory}")
        self.manager = ocp.CheckpointManager(
            self.directory,
            # A save cut short (crash, full disk) leaves a *.orbax-checkpoint-tmp directory: removed on reopening,
            # so the space comes back and the step can be saved again.
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                                 create=not read_only, read_only=read_only,
                                                 cleanup_tmp_directories=not read_only),
        )

    def steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first."""
        return sorted(self.manager.all_steps())

    def has(self, step: int) -> bool:
        """Whether `step` is saved or being saved."""
        return step == self._in_flight or step in self.manager.all_steps()

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Start saving (returns once the state is copied off the devices, if async).

        A failed write (this save's, or an async one still in flight) raises CheckpointWriteError
        naming the directory; Orbax renames a step into place only once complete, so the steps
        already there stay restorable.
        """
        self.wait()  # what Orbax's save would do first; waiting here names the step that failed
        with self._writing(step):
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                            meta=ocp.args.JsonSave(meta)), force=True)
        self._in_flight = step

    def wait(self) -> None:
        """Block until every save in flight is on disk (CheckpointWriteError if one failed)."""
        with self._writing(self._in_flight):
            self.manager.wait_until_finished()
        self._in_flight = None

    @contextlib.contextmanager
    def _writing(self, step: int | None):
        if self.failed:  # Orbax re-raises a failed async save at every later call
            raise CheckpointWriteError(self.failed)
        try:
            yield
        except Exception as err:
            first = _first_line(err, 300)
            which = f"checkpoint step {step}" if step is not None else "a checkpoint"
            # From the directory, not the manager: it already drops the steps rotation will delete once the
            # new one is complete, which it now never will be.
            done = sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and p.is_dir())
            self.failed = (f"writing {which} to {self.directory} failed ({type(err).__name__}: {first}); the "
                           f"complete checkpoints there (steps {done}) are intact, and a rerun resumes from "
                           "the latest once the directory can be written (free space, permissions)")
            raise CheckpointWriteError(self.failed) from None

    def read_meta(self, step: int) -> dict:
        """The JSON record saved with a step."""
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore_latest(self, target: Callable[[dict], Any], check: Callable[[dict], None],
                       verify: Callable[[Any, dict], str | None] = lambda state, meta: None,
                       only: int | None = None) -> tuple[int, Any, dict] | None:
        """The newest loadable checkpoint (or step `only`) as (step, state, meta), or None when there is none.

        `check(meta)` raises for a checkpoint this run cannot use (another architecture).
        `target(meta)` is the abstract state, with the shardings to restore into, for a checkpoint with this meta.
        `verify(state, meta)` says why a restored state is damaged (None: sound). A damaged step is
        skipped with a warning naming it and, unless read-only, moved to `damaged_checkpoints/`
        beside this directory, so a resumed run can save that step number again.
        """
        steps = self.steps() if only is None else [only]
        for step in reversed(steps):
            try:
                meta = self.read_meta(step)
            except Exception as err:  # any unreadable checkpoint is skipped the same way
                self._damaged(step, f"its metadata is unreadable ({type(err).__name__})")
                continue
            check(meta)
            try:
                restored = self.manager.restore(
                    step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target(meta))))
            except Exception as err:  # Orbax raises many types for a damaged step: fall back to the one before
                self._damaged(step, f"it cannot be read ({_root_cause(err)})")
                continue
            why = verify(restored["state"], meta)
            if why:
                self._damaged(step, why)
                continue
            return step, restored["state"], meta
        if only is not None:
            raise ConfigError(f"checkpoint {self.directory}/{only} cannot be restored (see the warning above)")
        if steps:
            raise ConfigError(f"no checkpoint in {self.directory} can be restored (all of steps {steps} "
                              "are damaged); move the directory aside or set a new run.dir")
        return None

    def _damaged(self, step: int, why: str) -> None:
        """Warn about a damaged step and, unless read-only, move it out of the way."""
        path = self.directory / str(step)
        if self.read_only:
            log.warning("checkpoint %s is damaged: %s; trying the one before it", path, why)
            return
        aside = self._set_aside(step, "damaged_checkpoints")
        log.warning("checkpoint %s is damaged: %s; moved to %s, trying the one before it", path, why, aside)

    def supersede_after(self, step: int) -> list[Path]:
        """Move the complete steps newer than `step` to `superseded_checkpoints/` beside this directory,
        so a run resumed from `step` saves those numbers again."""
        return [self._set_aside(s, "superseded_checkpoints") for s in self.steps() if s > step]

    def _set_aside(self, step: int, folder: str) -> Path:
        """Rename a step's directory into `folder` beside this directory (never over an earlier one).

        Process 0 renames; every process then waits for it and rereads the directory, so none
        still sees the step (Orbax refuses to save a step it believes exists).
        """
        path, aside = self.directory / str(step), self.directory.parent / folder / str(step)
        n = 1
        while aside.exists():
            aside, n = aside.with_name(f"{step}.{n}"), n + 1
        if jax.process_index() == 0 and path.is_dir():
            aside.parent.mkdir(parents=True, exist_ok=True)
            path.rename(aside)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"spmd_train: {path} set aside")
        self.manager.reload()
        return aside

    def close(self) -> None:
        """Finish pending saves and release the manager (a write failure already reported is not raised again)."""
        reported = self.failed is not None
        try:
            self.wait()
        except CheckpointWriteError:
            if not reported:
                raise
        finally:
            with contextlib.suppress(Exception):
                self.manager.close()


def _root_cause(err: BaseException, limit: int = 300) -> str:
    """`Type: message` of the innermost exception behind `err`: Orbax wraps TensorStore's own reason (which file,
    which byte range) in a message that ends in the repr of a bound method."""
    seen = {id(err)}
    while (inner := err.__cause__ or err.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        err = inner
    return f"{type(err).__name__}: {_first_line(err, limit).split(' See full TensorStore details')[0]}"


def _first_line(err: Exception, limit: int) -> str:
    """An exception's first non-empty message line (Orbax's messages run to pages), at most `limit` characters."""
    return next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)[:limit]


def layout_meta(cfg: Config, mesh: jax.sharding.Mesh, rules: dict, param_shapes: Any) -> dict:
    """What a checkpoint records about the run that wrote it (JSON-serialisable)."""
    return {"format": FORMAT, "config": asdict(cfg), "mesh": dict(mesh.shape), "rules": rules,
            "param_shapes": _shape_record(param_shapes)}


def _shape_record(param_shapes: Any) -> dict[str, list[int]]:
    """Each parameter's path (`keystr`) -> its shape, as checkpoints record them."""
    return {jax.tree_util.keystr(path): list(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(param_shapes)[0]}


def model_differences(meta: dict, cfg: Config) -> list[str]:
    """'model.KEY: checkpoint A, this run B' for each key of the model section that differs (`preset` is a name)."""
    saved = asdict(model_from_record(meta.get("config", {}).get("model", {})))
    current = asdict(cfg.model)
    saved.pop("preset"), current.pop("preset")
    diffs = sorted(d for d in _differences(saved, current, "model") if not _free_change(*d))
    return [f"{key}: checkpoint {old!r}, this run {new!r}" for key, old, new in diffs]


def _free_change(key: str, old: Any, new: Any) -> bool:
    """A change that keeps the model and its state: the compute dtype (the state is stored in the parameters' dtype
    whatever the matmuls run in: bfloat16 on one machine, float16 with a loss scale on another), or the router biases'
    update rate between two numbers (moved otherwise from now on: DeepSeek-V3 stops moving them for its last tokens;
    adding or removing the biases is no such change)."""
    if key == "model.compute_dtype":
        return True
    return key == "model.moe.bias_update_rate" and old is not None and new is not None


def check_same_model(meta: dict, cfg: Config, where: str) -> None:
    """Resuming continues the same model and optimizer: a difference in the model section, or in the optimizer
    settings that shape its state (`optim.name`, Adafactor's momentum), is a ConfigError naming it (checked before any
    restore, so the checkpoint is not mistaken for a damaged one). The precision policy may change
    (`train.policy_change`)."""
    diffs = model_differences(meta, cfg)
    if diffs:
        raise ConfigError(f"the checkpoint in {where} was saved by a different model ({'; '.join(diffs)}); "
                          "use the same model settings, a new run.dir, or checkpoint.load_from to start a "
                          "new run from its parameters")
    saved = meta.get("config", {})
    diffs = state_differences(saved.get("optim", {}), cfg.optim)
    if diffs:
        raise ConfigError(f"the checkpoint in {where} was saved with another optimizer ({'; '.join(diffs)}), whose "
                          "state this run cannot continue; use the checkpoint's setting, a new run.dir, or "
                          "checkpoint.load_from to start a new run from its parameters")


def check_same_parameters(meta: dict, cfg: Config, param_shapes: Any, where: str) -> None:
    """Starting from another run's parameters needs the same parameter tree and shapes (dtypes are cast)."""
    saved, current = meta.get("param_shapes", {}), _shape_record(param_shapes)
    bad = [f"{k}: checkpoint {saved.get(k)}, this run {current.get(k)}"
           for k in sorted(saved.keys() | current.keys()) if saved.get(k) != current.get(k)]
    if bad:
        why = model_differences(meta, cfg) or ["no model key differs"]
        raise ConfigError(f"the parameters in {where} do not fit this model ({'; '.join(why)}); "
                          f"{len(bad)} parameters differ, e.g. {'; '.join(bad[:3])}")


def _differences(old: Any, new: Any, key: str) -> list[tuple[str, Any, Any]]:
    """(dotted key, old, new) for each leaf that differs; a section present on one side only is one entry."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in old.keys() | new.keys() for d in _differences(old.get(k), new.get(k), f"{key}.{k}")]
    return [] if old == new else [(key, old, new)]

"""Where a run starts: run.dir's checkpoint, checkpoint.load_from (Hugging Face or another run), or fresh."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from spmd_train.config.hf_config import hf_directory
from spmd_train.config.schema import Config
from spmd_train.errors import ConfigError
from spmd_train.hf.run import import_hf
from spmd_train.train.checkpoint import Checkpointer
from spmd_train.train.engine import Engine, TrainState
from spmd_train.train.metrics import read_history
from spmd_train.train.restore import load_from_source, restore_latest
from spmd_train.train.run_record import record_config


def starting_state(engine: Engine, cfg: Config, checkpointer: Checkpointer, run_dir: Path,
                   say: Callable[[str], None]) -> tuple[TrainState, list[dict[str, Any]]]:
    """The state a run starts from and its history so far: run.dir's latest checkpoint (train.resume_step's when
    set), else checkpoint.load_from's, else a fresh one."""
    existing = checkpointer.steps()
    if existing and cfg.train.resume == "never":
        raise ConfigError(f"run.dir={run_dir} already has checkpoints (steps {existing}) and "
                          "train.resume=never (valid: train.resume=auto to continue it, or a new run.dir)")
    chosen = cfg.train.resume_step
    if chosen is not None and chosen not in existing:
        raise ConfigError(f"train.resume_step={chosen}: {run_dir / 'checkpoints'} has no complete checkpoint "
                          f"at that step (valid: one of {existing})" if existing else
                          f"train.resume_step={chosen}: {run_dir} has no checkpoints to resume from "
                          "(valid: train.resume_step=null to start fresh)")
    restored = restore_latest(engine, cfg, checkpointer, run_dir, only=chosen) if existing else None
    if restored is None and cfg.train.resume != "never":
        _keep_history(run_dir)
    if restored is not None:
        step, state = restored
        for aside in checkpointer.supersede_after(step):
            say(f"train.resume_step={step}: moved the newer checkpoint {aside.name} to {aside.parent}")
        history = read_history(run_dir / "metrics.jsonl", step)
        say(f"resumed from {run_dir / 'checkpoints'} at step {step}")
    elif (hf := hf_directory(cfg.checkpoint.load_from)) is not None:
        state = engine.state_from_params(import_hf(engine, hf, run_dir))
        history = read_history(run_dir / "metrics.jsonl", 0)
        say(f"started from the Hugging Face checkpoint {hf}")
    else:
        state = engine.init_state()
        history = read_history(run_dir / "metrics.jsonl", 0)
        if cfg.checkpoint.load_from:
            state = _load_weights(engine, cfg, state, Path(cfg.checkpoint.load_from), say)
    return state, history


def _keep_history(run_dir: Path) -> None:
    """Refuse to start over in a run.dir whose checkpoints were all set aside as damaged while its metrics history
    remains: a requeued job would otherwise rewrite that history from step 1 without anyone asking for it."""
    damaged = run_dir / "damaged_checkpoints"
    metrics = run_dir / "metrics.jsonl"
    if not damaged.is_dir() or not any(damaged.iterdir()) or not metrics.exists() or not metrics.read_text().strip():
        return
    steps = sorted((p.name for p in damaged.iterdir()), key=lambda n: [int(x) for x in n.split(".") if x.isdigit()])
    raise ConfigError(f"run.dir={run_dir} has no checkpoint left to resume from: steps {steps} were set aside in "
                      f"{damaged} as damaged, and {metrics} keeps the run's history, which starting again would "
                      "rewrite (valid: train.resume=never to start over in this run.dir, a new run.dir, or a sound "
                      f"checkpoint put back in {run_dir / 'checkpoints'})")


def _load_weights(engine: Engine, cfg: Config, state: TrainState, path: Path,
                  say: Callable[[str], None]) -> TrainState:
    """checkpoint.load_from: a run.dir (its latest checkpoint), its checkpoints/ or one checkpoints/STEP."""
    source, run_dir, step = load_from_source(path, cfg.checkpoint.load_from)
    done, restored = restore_latest(engine, cfg, source, run_dir, same_run=False, only=step)
    say(f"started from the parameters of step {done} in {run_dir / 'checkpoints'}")
    return state._replace(params=restored.params)


def record_start(engine: Engine, cfg: Config, run_dir: Path, step: int, say: Callable[[str], None]) -> None:
    """Record in run.dir the config as given and what the engine derived from it; say what changed since the last
    start (process 0 only: one writer)."""
    # The config as given, then what the engine derived from it (ignored when the file is loaded).
    record = {**asdict(cfg), "resolved": engine.resolved()}
    changes = record_config(run_dir, record, step)
    if changes:
        say("config changed since the last start (recorded in config_changes.jsonl): "
            + ", ".join(f"{k}: {b!r} -> {a!r}" for k, (b, a) in list(changes.items())[:8])
            + (f" and {len(changes) - 8} more" if len(changes) > 8 else ""))

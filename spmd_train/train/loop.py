"""The training loop: build the engine, compile once, step, and log one metrics line per step."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax

from spmd_train.config.schema import Config
from spmd_train.train.data import SyntheticTokens
from spmd_train.train.engine import Engine, TrainState

log = logging.getLogger("spmd_train")


@dataclass(frozen=True)
class TrainResult:
    """What a finished run hands back: the final state and every step's metrics."""

    state: TrainState
    history: list[dict[str, Any]]
    compile_time_s: float
    loss_floor: float
    """Best achievable loss on the training data (nats per token)."""


def train(cfg: Config, devices: list[jax.Device] | None = None) -> TrainResult:
    """Train for `train.steps` optimizer steps, writing `run.dir/metrics.jsonl` (one object per step)."""
    engine = Engine.build(cfg, devices)
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    data = SyntheticTokens(
        cfg.model.vocab_size, cfg.train.seq_len, cfg.train.global_batch_size,
        successors=cfg.data.successors, seed=cfg.train.seed,
    )
    log.info(
        "mesh %s on %d %s devices, %s parameters, loss floor %.4f",
        dict(engine.mesh.shape), engine.mesh.size, engine.mesh.devices.flat[0].platform, f"{engine.num_params:,}",
        data.loss_floor,
    )
    state = engine.init_state()
    t0 = time.perf_counter()
    step_fn = engine.train_step.lower(state, data.batch(0, engine.batch_sharding)).compile()
    compile_time = time.perf_counter() - t0
    log.info("train step compiled in %.2f s", compile_time)

    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
    history: list[dict[str, Any]] = []
    with open(run_dir / "metrics.jsonl", "w") as sink:
        pending = None
        last_done = time.perf_counter()
        for step in range(cfg.train.steps):
            state, metrics = step_fn(state, data.batch(step, engine.batch_sharding))
            # At most one step in flight: wait for the previous step while this one runs.
            if pending is not None:
                last_done = _finish(pending, last_done, tokens_per_step, engine.mesh.size, history, sink, cfg)
            pending = (step + 1, metrics)
        if pending is not None:
            _finish(pending, last_done, tokens_per_step, engine.mesh.size, history, sink, cfg)
    return TrainResult(state=state, history=history, compile_time_s=compile_time, loss_floor=data.loss_floor)


def _finish(pending, last_done, tokens_per_step, num_devices, history, sink, cfg: Config) -> float:
    step, metrics = pending
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
    done = time.perf_counter()
    step_time = done - last_done
    record = {
        "step": step,
        "loss": values["loss"],
        "grad_norm": values["grad_norm"],
        "lr": values["lr"],
        "step_time_s": step_time,
        "tokens_per_sec": tokens_per_step / step_time,
        "tokens_per_sec_per_device": tokens_per_step / step_time / num_devices,
    }
    history.append(record)
    sink.write(json.dumps(record) + "\n")
    sink.flush()
    if step == 1 or step % cfg.run.log_every == 0 or step == cfg.train.steps:
        log.info(
            "step %d/%d  loss %.4f  grad_norm %.3f  lr %.2e  %.0f tok/s",
            step, cfg.train.steps, record["loss"], record["grad_norm"], record["lr"], record["tokens_per_sec"],
        )
    return done

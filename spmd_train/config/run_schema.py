"""The `run` and `checkpoint` sections: the output directory, logging, processes, and checkpoints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from spmd_train.config.field_types import STRICT, NonNegativeInt, PositiveFloat, PositiveInt


def _check_host_port(address: str | None) -> str | None:
    # jax splits the address at its last ':' and fails with an IndexError when there is none.
    host, sep, port = (address or "").rpartition(":")
    if address is not None and not (sep and host and port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError("give host:port of process 0, e.g. 10.0.0.1:1234 (a port from 1 to 65535)")
    return address


HostPort = Annotated[str | None, AfterValidator(_check_host_port)]


@dataclass(frozen=True)
class RunConfig:
    """Output directory, logging cadence and device simulation."""

    __pydantic_config__ = STRICT

    dir: str = "runs/default"
    simulate_devices: PositiveInt | None = None
    log_every: PositiveInt = 10
    peak_tflops: PositiveFloat | None = None
    """Peak dense TFLOP/s per device for MFU; default: looked up by device kind (none on CPU)."""
    profile_steps: tuple[int, ...] = ()
    """[first, last] 1-based steps to capture a jax profiler trace of, into run.dir/profile."""
    distributed: bool = False
    """Start JAX's multi-controller runtime, detecting the cluster (SLURM, TPU pod, ...) from the environment."""
    coordinator: HostPort = None
    """host:port of process 0; with num_processes and process_id, starts the runtime explicitly."""
    num_processes: PositiveInt | None = None
    process_id: NonNegativeInt | None = None
    peer_timeout_s: PositiveInt = 120
    """Multi-process runs: a process that sends JAX's coordination service no heartbeat for this long (killed,
    frozen, its host lost) is declared dead and every other process stops, naming it, instead of waiting forever
    in a collective; one whose main thread hangs is caught by the step watchdog after twice this."""
    wandb: bool = False
    """Mirror every step record to Weights & Biases (the `wandb` extra); one W&B run per run.dir, resumed with it."""
    wandb_project: Annotated[str, Field(min_length=1)] = "spmd_train"
    wandb_mode: Literal["online", "offline"] | None = None
    """offline: write to run.dir/wandb only (no network; `wandb sync` later); default: W&B's own (WANDB_MODE)."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints in run.dir/checkpoints."""

    __pydantic_config__ = STRICT

    every: NonNegativeInt = 100
    """Save every this many steps (0: only the final save)."""
    keep: PositiveInt = 3
    async_save: bool = True
    load_from: str | None = None
    """Start from the parameters of another run's checkpoint (a run.dir or a checkpoints/STEP directory)."""

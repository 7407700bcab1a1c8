"""The run-config schema: one frozen dataclass per section.

These dataclasses are the single source of truth for config keys, types and defaults.
They import nothing from jax so the CLI can read a config (and `run.simulate_devices`)
before jax initialises. Validation is done by `spmd_train.config.load`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import ConfigDict

# Unknown keys are errors and values are not coerced between types ("64" is not an int).
_STRICT = ConfigDict(extra="forbid", strict=True)

MESH_AXES = ("data", "pipeline", "fsdp", "sequence", "expert", "tensor")
"""Public mesh axis names, outermost first: the fastest links go to the last axes."""

DType = Literal["float32", "bfloat16"]
RematPolicy = Literal["none", "full", "save_matmuls", "save_matmuls_no_batch"]


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer architecture (Llama-style)."""

    __pydantic_config__ = _STRICT

    preset: str | None = None
    num_layers: int = 2
    d_model: int = 64
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int | None = None
    d_ff: int = 128
    vocab_size: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    compute_dtype: DType = "float32"
    param_dtype: DType = "float32"
    attention: Literal["auto", "pallas", "cudnn", "xla"] = "auto"
    """auto: Pallas kernel on TPU, cuDNN on GPU, plain XLA on CPU (where Pallas runs only in interpret mode)."""

    @property
    def resolved_head_dim(self) -> int:
        """Per-head width: `head_dim` when set, else d_model // num_heads."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads


@dataclass(frozen=True)
class AxisFactors:
    """Slow-link (DCN / inter-node) factor of each mesh axis; 1 means all on fast links."""

    __pydantic_config__ = _STRICT

    data: int = 1
    pipeline: int = 1
    fsdp: int = 1
    sequence: int = 1
    expert: int = 1
    tensor: int = 1


@dataclass(frozen=True)
class RulesConfig:
    """Logical axis name -> mesh axes, separately for parameters and activations."""

    __pydantic_config__ = _STRICT

    params: dict[str, tuple[str, ...]] = field(
        default_factory=lambda: {
            "layers": (),
            "embed": ("fsdp",),
            "vocab": ("tensor",),
            "heads": ("tensor",),
            "kv_heads": ("tensor",),
            "head_dim": (),
            "mlp": ("tensor",),
        }
    )
    activations: dict[str, tuple[str, ...]] = field(
        default_factory=lambda: {
            "batch": ("data", "fsdp", "expert"),
            "norm_length": ("sequence",),
            "length": ("sequence",),
            "embed": (),
            "heads": ("tensor",),
            "kv_heads": ("tensor",),
            "head_dim": (),
            "mlp": ("tensor",),
            "vocab": ("tensor",),
        }
    )


@dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes (one may be -1: fill with the remaining devices) and layout."""

    __pydantic_config__ = _STRICT

    preset: str | None = None
    data: int = 1
    pipeline: int = 1
    fsdp: int = -1
    sequence: int = 1
    expert: int = 1
    tensor: int = 1
    dcn: AxisFactors = field(default_factory=AxisFactors)
    rules: RulesConfig = field(default_factory=RulesConfig)

    def sizes(self) -> dict[str, int]:
        """Axis sizes as written (possibly with one -1), in mesh order."""
        return {name: getattr(self, name) for name in MESH_AXES}


@dataclass(frozen=True)
class ParallelConfig:
    """How parameters, gradients and optimizer state are split, and rematerialisation."""

    __pydantic_config__ = _STRICT

    zero_stage: Literal[0, 1, 2, 3] = 3
    sequence_parallel: bool = False
    remat: RematPolicy = "none"


@dataclass(frozen=True)
class TrainConfig:
    """Batch geometry, step count and seed."""

    __pydantic_config__ = _STRICT

    steps: int = 100
    global_batch_size: int = 8
    seq_len: int = 64
    grad_accum: int = 1
    seed: int = 0
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from the latest complete checkpoint in run.dir; never: refuse a run.dir that has checkpoints."""


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup, cosine decay and global-norm clipping."""

    __pydantic_config__ = _STRICT

    lr: float = 3e-4
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8


@dataclass(frozen=True)
class DataConfig:
    """Where training tokens come from: a Markov chain, token files (.bin) or text read as bytes."""

    __pydantic_config__ = _STRICT

    source: Literal["markov", "tokens", "text"] = "markov"
    vocab_size: int | None = None
    """Markov chain vocabulary; defaults to model.vocab_size."""
    order: int = 1
    concentration: float = 0.1
    """Dirichlet concentration of each Markov transition row: small = peaky, large = near uniform."""
    paths: tuple[str, ...] = ()
    token_dtype: Literal["auto", "uint16", "uint32"] = "auto"
    val_fraction: float = 0.01
    packing: bool = True


@dataclass(frozen=True)
class RunConfig:
    """Output directory, logging cadence and device simulation."""

    __pydantic_config__ = _STRICT

    dir: str = "runs/default"
    simulate_devices: int | None = None
    log_every: int = 10
    peak_tflops: float | None = None
    """Peak dense TFLOP/s per device for MFU; default: looked up by device kind (none on CPU)."""
    profile_steps: tuple[int, ...] = ()
    """[first, last] 1-based steps to capture a jax profiler trace of, into run.dir/profile."""
    distributed: bool = False
    """Start JAX's multi-controller runtime, detecting the cluster (SLURM, TPU pod, ...) from the environment."""
    coordinator: str | None = None
    """host:port of process 0; with num_processes and process_id, starts the runtime explicitly."""
    num_processes: int | None = None
    process_id: int | None = None


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints in run.dir/checkpoints."""

    __pydantic_config__ = _STRICT

    every: int = 100
    """Save every this many steps (0: only the final save)."""
    keep: int = 3
    async_save: bool = True
    load_from: str | None = None
    """Start from the parameters of another run's checkpoint (a run.dir or a checkpoints/STEP directory)."""


@dataclass(frozen=True)
class Config:
    """A complete run configuration."""

    __pydantic_config__ = _STRICT

    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)

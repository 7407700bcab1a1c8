"""The run-config schema: one frozen dataclass per section.

These dataclasses are the single source of truth for config keys, types and defaults.
They import nothing from jax so the CLI can read a config (and `run.simulate_devices`)
before jax initialises. Validation is done by `spmd_train.config.load`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import AfterValidator, ConfigDict, Field

# Unknown keys are errors and values are not coerced between types ("64" is not an int).
_STRICT = ConfigDict(extra="forbid", strict=True)

MESH_AXES = ("data", "pipeline", "fsdp", "sequence", "expert", "tensor")
"""Public mesh axis names, outermost first: the fastest links go to the last axes."""

MeshAxis = Literal[MESH_AXES]
DType = Literal["float32", "bfloat16"]
AttentionImpl = Literal["auto", "pallas", "cudnn", "xla"]
MoEImpl = Literal["capacity", "dropless"]
RematPolicy = Literal["none", "full", "save_matmuls", "save_matmuls_no_batch"]

# Single-key ranges live in the types: pydantic names the key, the value and the bound.
# Sizes, counts and ids meet int32 on the devices (token ids, positions, the step counter); past int64 they
# would fail deep inside jax ("model.d_model=9223372036854775808": a TypeError), so the bound is the type's.
PositiveInt = Annotated[int, Field(ge=1, le=2**31 - 1)]
NonNegativeInt = Annotated[int, Field(ge=0, le=2**31 - 1)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Fraction = Annotated[float, Field(ge=0, le=1)]
"""A float in [0, 1]."""
Decay = Annotated[float, Field(ge=0, lt=1)]
"""A moment decay rate in [0, 1)."""
MAX_STEPS = 2**31 - 1
"""The step counter is int32 on the devices."""

LOGICAL_AXES = ("batch", "length", "norm_length", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "experts",
                "expert_mlp", "router_experts", "layers", "sublayers")
"""Every logical axis name the model code speaks; `mesh.rules` maps these (and only these) to mesh axes."""


def _check_logical_names(table: dict) -> dict:
    unknown = [name for name in table if name not in LOGICAL_AXES]
    if unknown:
        import difflib

        hints = [f"{n!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(n, LOGICAL_AXES, n=1))
                 else repr(n) for n in unknown]
        raise ValueError(f"unknown logical axis name {', '.join(hints)}; valid: {', '.join(LOGICAL_AXES)}")
    # A mesh axis can split a dimension only once: jax refuses P(('tensor', 'tensor')) deep inside the engine.
    for name, axes in table.items():
        if len(set(axes)) < len(axes):
            raise ValueError(f"{name!r} maps to {list(axes)}, naming a mesh axis twice (valid: each mesh axis at "
                             f"most once, e.g. {list(dict.fromkeys(axes))})")
    return table


RulesTable = Annotated[dict[str, tuple[MeshAxis, ...]], AfterValidator(_check_logical_names)]


def _check_axis_size(size: int) -> int:
    if size == 0 or size < -1:
        raise ValueError("an axis size is a positive integer or -1 (fill with the remaining devices)")
    return size


def _check_blocks(blocks: tuple[int, int] | None) -> tuple[int, int] | None:
    if blocks is not None and any(b < 8 or b % 8 for b in blocks):
        raise ValueError("block_q and block_k must be positive multiples of 8 (e.g. [512, 512] on TPU, "
                         "[128, 128] on GPU)")
    return blocks


def _check_host_port(address: str | None) -> str | None:
    # jax splits the address at its last ':' and fails with an IndexError when there is none.
    host, sep, port = (address or "").rpartition(":")
    if address is not None and not (sep and host and port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError("give host:port of process 0, e.g. 10.0.0.1:1234 (a port from 1 to 65535)")
    return address


AxisSize = Annotated[int, AfterValidator(_check_axis_size)]
Blocks = Annotated[tuple[int, int] | None, AfterValidator(_check_blocks)]
HostPort = Annotated[str | None, AfterValidator(_check_host_port)]


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts: which layers route each token to k of E SwiGLU experts, and the router's losses."""

    __pydantic_config__ = _STRICT

    every: PositiveInt = 1
    """Every k-th layer's MLP is an MoE layer (1: all of them); must divide model.num_layers."""
    num_experts: PositiveInt = 8
    """Routed experts per MoE layer (split over mesh.expert)."""
    experts_per_token: PositiveInt = 2
    """Top-k: experts each token is sent to (at most num_experts)."""
    d_ff: PositiveInt | None = None
    """Hidden width of each expert's SwiGLU; defaults to model.d_ff."""
    num_shared_experts: NonNegativeInt = 0
    """Experts every token goes through (one SwiGLU of width num_shared_experts x d_ff)."""
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    """How router logits become expert scores before top-k (gates are renormalised to sum to 1)."""
    router_aux_weight: NonNegativeFloat = 0.01
    """Weight of the load-balancing loss (Switch/GShard) in the training loss."""
    router_z_weight: NonNegativeFloat = 0.001
    """Weight of the router z-loss (mean squared logsumexp of router logits)."""


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequencies stretched for long context: Llama 3.1's per-band rule, or plain linear interpolation."""

    __pydantic_config__ = _STRICT

    type: Literal["llama3", "linear"]
    """llama3: long wavelengths divided by `factor`, short ones kept, a smooth ramp between; linear: all divided."""
    factor: PositiveFloat
    low_freq_factor: PositiveFloat = 1.0
    """llama3: wavelengths above original_max_position / low_freq_factor are scaled fully."""
    high_freq_factor: PositiveFloat = 4.0
    """llama3: wavelengths below original_max_position / high_freq_factor are kept."""
    original_max_position: PositiveInt = 8192
    """llama3: the context length the model was first trained at."""


@dataclass(frozen=True)
class ModelConfig:
    """The model: a decoder-only transformer (Llama-style), optionally with MoE layers.

    This section is the architecture: a checkpoint resumes only into the same section (how it is
    computed, the attention and expert implementations, is the `backends` section).
    """

    __pydantic_config__ = _STRICT

    preset: str | None = None
    num_layers: PositiveInt = 2
    d_model: PositiveInt = 64
    num_heads: PositiveInt = 8
    num_kv_heads: PositiveInt = 4
    head_dim: PositiveInt | None = None
    d_ff: PositiveInt = 128
    vocab_size: PositiveInt = 256
    rope_theta: PositiveFloat = 10000.0
    rope_scaling: RopeScaling | None = None
    """Stretched rotary frequencies (Llama 3.1/3.2); null: plain RoPE."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over each head's query and key before RoPE (Qwen3)."""
    sliding_window: PositiveInt | None = None
    """A published model's attention window (Mistral); recorded, and sequences must fit inside it."""
    norm_eps: NonNegativeFloat = 1e-5
    tie_embeddings: bool = False
    init_std: PositiveFloat = 0.02
    compute_dtype: DType = "float32"
    param_dtype: DType = "float32"
    moe: MoEConfig | None = None
    """Mixture-of-experts layers; null: a dense model."""

    @property
    def resolved_head_dim(self) -> int:
        """Per-head width: `head_dim` when set, else d_model // num_heads."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    @property
    def moe_every(self) -> int:
        """Every how many layers an MoE layer comes (0: a dense model)."""
        return self.moe.every if self.moe is not None else 0

    @property
    def stack_rows(self) -> int:
        """Rows of the stacked layer parameters: one per layer, or per MoE group (every > 1 layers ending in MoE)."""
        return self.num_layers // self.moe_every if self.moe_every > 1 else self.num_layers

    @property
    def resolved_moe_d_ff(self) -> int:
        """Per-expert hidden width: `moe.d_ff` when set, else d_ff."""
        return self.moe.d_ff if self.moe is not None and self.moe.d_ff is not None else self.d_ff


@dataclass(frozen=True)
class BackendsConfig:
    """Which implementation computes attention and the experts; resolved once per run (`parallel.Backends`)."""

    __pydantic_config__ = _STRICT

    attention: AttentionImpl = "auto"
    """auto: Pallas kernel on TPU, cuDNN on GPU, plain XLA on CPU (where Pallas runs only in interpret mode)."""
    attention_blocks: Blocks = None
    """(block_q, block_k) of the Pallas kernels; None: per-backend defaults (TPU 512 x 512, GPU 128 x 128)."""
    moe: MoEImpl = "capacity"
    """capacity: fixed slots per expert, overflow dropped (all-to-all); dropless: ragged all-to-all (GPU/TPU only)."""
    capacity_factor: PositiveFloat = 1.25
    """moe=capacity: slots per expert = ceil(k x tokens per group x capacity_factor / num_experts)."""


@dataclass(frozen=True)
class AxisFactors:
    """Slow-link (DCN / inter-node) factor of each mesh axis; 1 means all on fast links."""

    __pydantic_config__ = _STRICT

    data: PositiveInt = 1
    pipeline: PositiveInt = 1
    fsdp: PositiveInt = 1
    sequence: PositiveInt = 1
    expert: PositiveInt = 1
    tensor: PositiveInt = 1


@dataclass(frozen=True)
class RulesConfig:
    """Logical axis name -> mesh axes: a named preset (`meshes/rules/NAME.yaml`) with per-entry overrides.

    Once loaded, `activations` is the preset's activation table with the config's entries on top,
    and `params` the entries where parameters differ from it (the preset's, then the config's).
    The effective tables, with the rules the code adds, come from `config.rules.resolve_rules`.
    """

    __pydantic_config__ = _STRICT

    preset: str = "default"
    activations: RulesTable = field(default_factory=dict)
    params: RulesTable = field(default_factory=dict)


@dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes (one may be -1: fill with the remaining devices) and layout."""

    __pydantic_config__ = _STRICT

    preset: str | None = None
    data: AxisSize = 1
    pipeline: AxisSize = 1
    fsdp: AxisSize = -1
    sequence: AxisSize = 1
    expert: AxisSize = 1
    tensor: AxisSize = 1
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
    context_parallel: Literal["allgather", "ring", "ulysses"] = "allgather"
    """How attention sees the other devices' tokens when mesh.sequence > 1 (docs/context.md)."""
    remat: RematPolicy = "none"
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v"] = "1f1b"
    """Microbatch schedule of the pipeline stages (used when mesh.pipeline > 1)."""
    pipeline_microbatches: PositiveInt | None = None
    """Microbatches per pipeline flush; default 4 x mesh.pipeline (fewer if the batch does not divide)."""
    virtual_stages: PositiveInt = 1
    """Chunks of layers per device: >= 2 for interleaved_1f1b, exactly 2 for zb_v, 1 otherwise."""
    pipeline_layers: tuple[int, ...] | Literal["balanced"] | None = None
    """Layers in each pipeline stage chunk, in model order (mesh.pipeline x virtual_stages numbers summing to
    model.num_layers, e.g. [3, 4, 4, 3]); "balanced": the split whose costliest chunk, LM head included, costs least
    (equal chunks under zb_h1 and zb_v, which cannot run uneven ones); null: equal stages (docs/pipeline.md,
    "Uneven stages")."""


@dataclass(frozen=True)
class TrainConfig:
    """Batch geometry, step count and seed."""

    __pydantic_config__ = _STRICT

    steps: Annotated[int, Field(ge=1, le=MAX_STEPS)] = 100
    global_batch_size: PositiveInt = 8
    seq_len: PositiveInt = 64
    grad_accum: PositiveInt = 1
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] = 0
    """numpy's generators (the data) take no negative seed, and jax's keys at most an int64."""
    eval_every: NonNegativeInt = 0
    """Mean loss on the held-out split every this many steps (0: never), as `val_loss` in the metrics."""
    eval_batches: PositiveInt = 4
    """Global batches of the held-out split each evaluation averages over (the same ones every time)."""
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from the latest complete checkpoint in run.dir; never: refuse a run.dir that has checkpoints."""
    resume_step: PositiveInt | None = None
    """Resume from this checkpoint step of run.dir instead of the latest; newer steps are moved to
    run.dir/superseded_checkpoints/ (kept, not deleted) so the run can save those step numbers again."""
    on_nonfinite: Literal["skip", "halt"] = "skip"
    """A step whose loss or gradient norm is NaN or infinite is never applied; skip: go on with the next batch;
    halt: stop the run (exit code 3) at the first one."""
    spike_sigma: PositiveFloat | None = 6.0
    """Skip a step whose loss or gradient norm exceeds the mean of the last `spike_window` applied steps by this
    many standard deviations (at least 1% of the mean); null: never skip for a spike."""
    spike_window: Annotated[int, Field(ge=2, le=MAX_STEPS)] = 128
    """Applied steps the spike statistics are taken over; judging starts once that many have been applied."""
    max_consecutive_skips: PositiveInt = 10
    """Stop the run (exit code 3) after this many skipped steps in a row."""


OptimizerName = Literal["adamw", "adafactor", "lion"]
LRSchedule = Literal["cosine", "wsd", "linear", "constant", "inverse_sqrt"]


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer (AdamW, Adafactor or Lion, all from optax), learning-rate schedule and global-norm clipping."""

    __pydantic_config__ = _STRICT

    name: OptimizerName = "adamw"
    """adamw; adafactor (factored second moments: row and column vectors per matrix); lion (sign of a momentum,
    one state array per parameter; its authors advise a 3-10x smaller `lr` and larger `weight_decay` than
    AdamW's, README has tuned values). A run resumes only with the optimizer it was started with."""
    lr: NonNegativeFloat = 3e-4
    """Peak learning rate (0 leaves the weights as they are); for adafactor a step relative to each matrix's RMS."""
    schedule: LRSchedule = "cosine"
    """After a linear warmup from 0: cosine, wsd (constant, then linear over the last `decay_fraction`), linear,
    constant or inverse_sqrt down to lr * min_lr_ratio (formulas: `train/optimizer.py`); may change on resume."""
    warmup_steps: NonNegativeInt = 10
    min_lr_ratio: Fraction = 0.1
    """Final learning rate of the decay (the floor of inverse_sqrt), as a fraction of `lr` (1: no decay)."""
    decay_fraction: Fraction = 0.2
    """schedule=wsd: the last fraction of train.steps over which the learning rate decays (0: none)."""
    weight_decay: NonNegativeFloat = 0.1
    """Decoupled weight decay of matrices, scaled by the schedule as in AdamW: p -= lr_t * weight_decay * p."""
    clip_norm: PositiveFloat | None = 1.0
    """Clip the gradient to this global norm; null: no clipping."""
    b1: Decay | None = None
    """First-moment decay; null: the optimizer's default (adamw 0.9, lion 0.9, adafactor none). Set with adafactor,
    it adds a momentum to its state, so an adafactor run resumes only with b1 set or unset as it started."""
    b2: Decay | None = None
    """Second-moment decay (lion: the momentum's own decay); null: adamw 0.95, lion 0.99. Adafactor's decay is
    1 - t^-0.8 by step, so a value set with adafactor is an error."""
    eps: NonNegativeFloat | None = None
    """AdamW's denominator epsilon; null: 1e-8. Lion has none and adafactor's differs in kind: set with either,
    an error."""


@dataclass(frozen=True)
class DataConfig:
    """Where training tokens come from: a Markov chain, token files (.bin) or text read as bytes."""

    __pydantic_config__ = _STRICT

    source: Literal["markov", "tokens", "text"] = "markov"
    vocab_size: PositiveInt | None = None
    """Markov chain vocabulary; defaults to model.vocab_size."""
    order: Annotated[int, Field(ge=1, le=24)] = 1
    """Tokens of context; the transition table (vocab_size ** (order + 1) entries) outgrows memory past 24 even for
    a vocabulary of 2 (and `data.order=2147483647` made a number too long to print in the error: a ValueError)."""
    concentration: PositiveFloat = 0.1
    """Dirichlet concentration of each Markov transition row: small = peaky, large = near uniform."""
    paths: tuple[str, ...] = ()
    token_dtype: Literal["auto", "uint16", "uint32"] = "auto"
    val_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.01
    packing: bool = True
    document_mask: bool | None = None
    """Attention and the loss stay inside each document of a packed window; default: true for packed token files."""
    eot_id: NonNegativeInt | None = None
    """Token ending each document in .bin files without NAME.docs.npy (GPT-2: 50256); default: the sidecar's."""
    prefetch: Annotated[int, Field(ge=0, le=64)] = 2
    """Batches a background thread makes ahead of the step (0: each batch made by the loop when its step starts)."""

    @property
    def masks_documents(self) -> bool:
        """Whether batches carry document segments: `document_mask`, or by default packed token files."""
        return (self.source == "tokens" and self.packing) if self.document_mask is None else self.document_mask


@dataclass(frozen=True)
class RunConfig:
    """Output directory, logging cadence and device simulation."""

    __pydantic_config__ = _STRICT

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

    __pydantic_config__ = _STRICT

    every: NonNegativeInt = 100
    """Save every this many steps (0: only the final save)."""
    keep: PositiveInt = 3
    async_save: bool = True
    load_from: str | None = None
    """Start from the parameters of another run's checkpoint (a run.dir or a checkpoints/STEP directory)."""


@dataclass(frozen=True)
class Config:
    """A complete run configuration."""

    __pydantic_config__ = _STRICT

    model: ModelConfig = field(default_factory=ModelConfig)
    backends: BackendsConfig = field(default_factory=BackendsConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)

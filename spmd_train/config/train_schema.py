"""The `train`, `optim` and `data` sections: batch geometry and step count, the optimizer, the tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from spmd_train.config.field_types import (
    MAX_STEPS,
    STRICT,
    Decay,
    Fraction,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
)
from spmd_train.config.optimizer_facts import optimizer_names


@dataclass(frozen=True)
class TrainConfig:
    """Batch geometry, step count and seed."""

    __pydantic_config__ = STRICT

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
    """auto: continue from the latest complete checkpoint in run.dir (refused when every checkpoint was set aside as
    damaged and the run has a history); never: refuse a run.dir that has checkpoints, and start over in one whose
    checkpoints were all set aside."""
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


OptimizerName = Literal[optimizer_names()]
"""optim.name's values: the optimizers `config.optimizer_facts` registers."""
LRSchedule = Literal["cosine", "wsd", "linear", "constant", "inverse_sqrt"]


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer (AdamW, Adafactor, Lion or Muon, all from optax), learning-rate schedule and global-norm clipping."""

    __pydantic_config__ = STRICT

    name: OptimizerName = "adamw"
    """adamw; adafactor (factored second moments: row and column vectors per matrix); lion (sign of a momentum,
    one state array per parameter; its authors advise a 3-10x smaller `lr` and larger `weight_decay` than
    AdamW's, README has tuned values); muon (Newton-Schulz-orthogonalised momentum on the hidden weight matrices,
    scaled to AdamW's update RMS so that AdamW's `lr` and `weight_decay` carry over; AdamW on the embedding, LM head,
    router, norms and biases). A run resumes only with the optimizer it was started with."""
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
    """First-moment decay; null: the optimizer's default (adamw 0.9, lion 0.9, adafactor none, muon 0.95: Muon's
    Nesterov momentum, its AdamW part keeping 0.9). Set with adafactor, it adds a momentum to its state, so an
    adafactor run resumes only with b1 set or unset as it started."""
    b2: Decay | None = None
    """Second-moment decay (lion: the momentum's own decay; muon: its AdamW part's); null: adamw 0.95, lion 0.99,
    muon 0.95. Adafactor's decay is 1 - t^-0.8 by step, so a value set with adafactor is an error."""
    eps: NonNegativeFloat | None = None
    """AdamW's denominator epsilon (muon: its AdamW part's); null: 1e-8. Lion has none and adafactor's differs in
    kind: set with either, an error."""


@dataclass(frozen=True)
class DataConfig:
    """Where training tokens come from: a Markov chain, token files (.bin) or text read as bytes."""

    __pydantic_config__ = STRICT

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

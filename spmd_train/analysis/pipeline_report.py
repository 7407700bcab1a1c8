"""The pipeline section of `describe`: the schedule of a pipelined step and the activation memory it implies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spmd_train.analysis.stage_costs import stage_shares
from spmd_train.models.flops import balanced_depths, flops_per_token
from spmd_train.parallel.schedule_simulator import simulate
from spmd_train.sharding.arithmetic import rows_per_device
from spmd_train.train.engine import Engine
from spmd_train.train.pipelined import chunk_depths, saved_bytes_per_microbatch, stash_bytes_per_microbatch


@dataclass(frozen=True)
class PipelineStage:
    """One pipeline stage under the schedule: its work and the VJP residuals it holds at most."""

    stage: int
    busy_ticks: int
    """Ticks this stage runs a forward or a backward (the rest of the step's ticks it idles)."""
    peak_in_flight: int
    """Most (microbatch, chunk) pairs whose forward has run and whose backward has not, at once."""
    stash_bytes: int
    """peak_in_flight x the stash of one (microbatch, chunk): the residuals this stage needs at most."""
    flops: float = 0.0
    """Model FLOPs this stage's devices each run per step: their layers' (`analysis.stage_costs`), the LM head on the
    stage of the last chunk; the mean over stages is the step's model FLOPs per device."""


@dataclass(frozen=True)
class PipelineReport:
    """The pipeline schedule of a step (mesh.pipeline > 1) and the activation memory it implies."""

    schedule: str
    stages: int
    microbatches: int
    """Microbatches per pipeline flush; one optimizer step runs train.grad_accum flushes."""
    virtual_stages: int
    microbatch_rows: int
    """Rows of one microbatch on one device (of the batch axes data x fsdp x expert)."""
    ticks: int
    bubble_fraction: float
    """Idle (stage, tick) slots / (stages x ticks), from simulating the schedule table."""
    bubble_fraction_formula: float
    """The closed form (p - 1) / (v m + p - 1) the schedules reach."""
    stash_bytes_per_microbatch: int
    """Bytes one (microbatch, chunk) forward keeps for its backward on one device (weights excluded;
    an upper bound when activations are split over `tensor`)."""
    stash_slots: int
    """Stash slots the compiled program reserves on every device: the SPMD program is the same on
    every stage, so it is sized for the stage that needs the most."""
    activation_slots: int
    cotangent_slots: int
    per_stage: list[PipelineStage]
    compiled_flops_all_branches: float | None
    """The loop-aware matmul FLOP count of the compiled program, which counts both the forward and
    the backward branch of the per-tick `lax.switch` on every tick (an over-count; see notes)."""
    saved_bytes_per_microbatch: int = 0
    """Split-backward schedules (zb_h1, zb_v): bytes B hands to W for one (microbatch, chunk) on one device (the
    per-matmul output cotangents W needs; an upper bound like the stash's); 0 for the fused schedules."""
    saved_slots: int = 0
    """Slots for those, reserved on every device (0 for the fused schedules)."""
    chunk_layers: tuple[int, ...] = ()
    """Layers in each model chunk, in model order (equal: the executor's stages hold equal stacks)."""
    balanced_layers: tuple[int, ...] = ()
    """The contiguous split of the layers into chunks (whole MoE groups) whose costliest chunk, LM head included,
    costs least (`analysis.stage_costs.balanced_depths`); equal to chunk_layers when no split is more even."""
    balanced_flops: tuple[float, ...] = ()
    """Per-stage FLOPs per device per step under balanced_layers."""

    @property
    def stash_bytes_reserved(self) -> int:
        """stash_slots x stash_bytes_per_microbatch: the stash buffers' size on every device."""
        return self.stash_slots * self.stash_bytes_per_microbatch

    @property
    def saved_bytes_reserved(self) -> int:
        """saved_slots x saved_bytes_per_microbatch: what B keeps for W, on every device."""
        return self.saved_slots * self.saved_bytes_per_microbatch

    def to_json(self) -> dict[str, Any]:
        """The `pipeline` section of `StepReport.to_json()`."""
        return {
            "schedule": self.schedule,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "virtual_stages": self.virtual_stages,
            "microbatch_rows": self.microbatch_rows,
            "ticks": self.ticks,
            "bubble_fraction": self.bubble_fraction,
            "bubble_fraction_formula": self.bubble_fraction_formula,
            "stash_bytes_per_microbatch": self.stash_bytes_per_microbatch,
            "stash_slots": self.stash_slots,
            "stash_bytes_reserved": self.stash_bytes_reserved,
            "saved_bytes_per_microbatch": self.saved_bytes_per_microbatch,
            "saved_slots": self.saved_slots,
            "saved_bytes_reserved": self.saved_bytes_reserved,
            "activation_slots": self.activation_slots,
            "cotangent_slots": self.cotangent_slots,
            "per_stage": [{"stage": s.stage, "busy_ticks": s.busy_ticks, "peak_in_flight": s.peak_in_flight,
                           "stash_bytes": s.stash_bytes, "flops": s.flops} for s in self.per_stage],
            "chunk_layers": list(self.chunk_layers),
            "balanced_layers": list(self.balanced_layers),
            "balanced_flops": list(self.balanced_flops),
            "compiled_flops_all_branches": self.compiled_flops_all_branches,
        }


PIPELINE_COLLECTIVES_NOTE = (
    "pipelined step: collectives inside a stage's forward or backward (its fsdp/tensor gathers and reductions) "
    "are counted on every tick for each branch of the per-tick lax.switch, so their counts and bytes are upper "
    "bounds, by about ticks / (virtual stages x microbatches); the per-tick pipeline collective-permutes and the "
    "collectives outside the pipeline are exact"
)


def pipeline_report(engine: Engine) -> PipelineReport:
    """The schedule's figures and the stash bytes they imply, from the plan the step was compiled with."""
    cfg, plan, sizes = engine.cfg, engine.plan, dict(engine.mesh.shape)
    sched, stats = plan.schedule, simulate(plan.schedule)
    p, m, v = sched.stages, sched.microbatches, sched.virtual
    rows = rows_per_device(cfg, sizes)
    per_mb = stash_bytes_per_microbatch(cfg, engine.block_graphdef, engine.param_shapes["blocks"], plan, rows)
    saved = (saved_bytes_per_microbatch(cfg, engine.block_graphdef, engine.param_shapes["blocks"], plan, rows)
             if sched.split_backward else 0)
    model, seq = cfg.model, cfg.train.seq_len
    per_device = flops_per_token(model, seq) * cfg.train.global_batch_size * seq / engine.mesh.size
    current = [rows * max(model.moe_every, 1) for rows in chunk_depths(cfg, p)]
    balanced = balanced_depths(model, seq, p * v)
    flops = lambda depths: [share * per_device * p for share in stage_shares(model, seq, depths, p, sched.placement)]
    return PipelineReport(
        schedule=sched.name, stages=p, microbatches=m, virtual_stages=v, microbatch_rows=rows // m,
        ticks=plan.num_ticks, bubble_fraction=stats.bubble_fraction,
        # Split schedules run 3 one-tick ops (F, B, W) per microbatch-chunk: ZB-H1's closed form, ZB-V's lower bound.
        bubble_fraction_formula=(p - 1) / ((3 if sched.split_backward else 1) * v * m + p - 1),
        stash_bytes_per_microbatch=per_mb, stash_slots=plan.stash_slots,
        activation_slots=plan.act_slots, cotangent_slots=plan.ct_slots,
        per_stage=[PipelineStage(stage=s, busy_ticks=stats.busy_ticks[s], peak_in_flight=stats.peak_in_flight[s],
                                 stash_bytes=stats.peak_in_flight[s] * per_mb, flops=f)
                   for s, f in zip(range(p), flops(current), strict=True)],
        compiled_flops_all_branches=None, saved_bytes_per_microbatch=saved, saved_slots=plan.saved_slots,
        chunk_layers=tuple(current), balanced_layers=tuple(balanced), balanced_flops=tuple(flops(balanced)),
    )

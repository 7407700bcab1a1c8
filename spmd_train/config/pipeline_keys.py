"""The pipeline keys (parallel.pipeline_*, virtual_stages) resolved, and checked where the config meets the mesh.

`Engine.build` and the planner's `real_check` call `check_pipeline` after `config.checks.check_layout` (which
checks parallel.virtual_stages against the schedule); the rules themselves live in `config.validity`.
"""

from __future__ import annotations

from collections.abc import Mapping

from spmd_train.config.schedule_facts import schedule_facts
from spmd_train.config.schema import Config
from spmd_train.config.validity import (
    chunks_divide_layers,
    chunks_fit_layers,
    chunks_hold_moe_groups,
    microbatches_divide_rows,
    refuse,
    schedule_request,
    staged_layers,
)
from spmd_train.errors import ConfigError


def check_pipeline(cfg: Config, sizes: Mapping[str, int], rows: int) -> None:
    """Pipeline keys against the model depth and the `rows` of the batch each device holds per step
    (`sharding.arithmetic.rows_per_device`), then the schedule's own numbers (`validity.schedule_request`)."""
    p, par, m, t = sizes["pipeline"], cfg.parallel, cfg.model, cfg.train
    v = par.virtual_stages
    equal = equal_stages(cfg)
    if equal:
        refuse(chunks_divide_layers(m.num_layers, p, v, preset=m.preset, pipeline_layers=par.pipeline_layers,
                                    schedule=par.pipeline_schedule, first_dense=m.first_dense))
    else:
        _check_pipeline_layers(cfg, p, v)
    micro = resolved_microbatches(cfg, p, rows)
    refuse(microbatches_divide_rows(micro, rows, t.global_batch_size, t.grad_accum))
    if equal:  # uneven chunks are whole MoE groups by `_check_pipeline_layers`
        refuse(chunks_hold_moe_groups(m.num_layers, m.moe_every, p, v, m.first_dense))
    refuse(schedule_request(par.pipeline_schedule, p, micro, v))


def equal_stages(cfg: Config) -> bool:
    """Whether every stage chunk holds the same layers: parallel.pipeline_layers null, or "balanced" under a
    split-backward schedule (B and W cannot split a padded chunk's backward, `train.pipelined.chunk_depths`)."""
    layers = cfg.parallel.pipeline_layers
    split = schedule_facts(cfg.parallel.pipeline_schedule).split_backward
    return layers is None or (layers == "balanced" and split)


def _check_pipeline_layers(cfg: Config, p: int, v: int) -> None:
    """parallel.pipeline_layers: p x v chunks of whole MoE groups, none empty, adding up to the staged layers (all of
    the model's but any first_dense ones; whether the schedule can run uneven chunks is `train.pipelined.chunk_depths`'
    to say, once "balanced" is resolved)."""
    par, m = cfg.parallel, cfg.model
    layers, chunks, unit = par.pipeline_layers, p * v, max(m.moe_every, 1)
    staged, named = staged_layers(m.num_layers, m.first_dense)
    where = f"mesh.pipeline={p}" + (f" x parallel.virtual_stages={v}" if v > 1 else "")
    if layers == "balanced":
        refuse(chunks_fit_layers(m.num_layers, m.moe_every, p, v, m.first_dense))
    else:
        shown = "[" + ", ".join(map(str, layers)) + "]"
        if len(layers) != chunks:
            raise ConfigError(f"parallel.pipeline_layers={shown} has {len(layers)} entries; {where} runs {chunks} "
                              f"stage chunks (valid: {chunks} layer counts in model order, summing to "
                              f"{named}, or balanced, or null for equal stages)")
        if min(layers) < 1:
            raise ConfigError(f"parallel.pipeline_layers={shown} gives a stage chunk no layers (valid: every entry "
                              f">= {unit}, summing to {named})")
        if sum(layers) != staged:
            raise ConfigError(f"parallel.pipeline_layers={shown} sums to {sum(layers)}, not {named} (valid: "
                              f"{chunks} positive layer counts summing to {staged})")
        if unit > 1 and any(n % unit for n in layers):
            raise ConfigError(f"parallel.pipeline_layers={shown} splits an MoE group: every entry must be a multiple "
                              f"of model.moe.every={unit} (the stack's rows are groups of {unit} layers ending in the "
                              "MoE layer)")


def resolved_microbatches(cfg: Config, stages: int, rows: int) -> int:
    """parallel.pipeline_microbatches, or by default `default_microbatches`."""
    if cfg.parallel.pipeline_microbatches is not None:
        return cfg.parallel.pipeline_microbatches
    return default_microbatches(stages, rows)


def default_microbatches(stages: int, rows: int) -> int:
    """The largest of 4p, 2p, p pipeline microbatches that divides a device's `rows` per step (p if none does)."""
    for m in (4 * stages, 2 * stages):
        if rows % m == 0:
            return m
    return stages

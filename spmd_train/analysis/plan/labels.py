"""A candidate's canonical short label (and back), and the config that runs it.

A label has up to three parts joined by " | ": the mesh axes of size > 1 in mesh order, the options, and the
slow-link factors, e.g. `fsdp=32 tensor=8 | zero3 remat=full sp | dcn fsdp=32`. Two candidates that run the same
program have the same label.

Format: docs/explanation/planner-model.md#labels
"""

from __future__ import annotations

import dataclasses
from enum import IntEnum
from typing import Any

from spmd_train.analysis.plan.candidate import CONTEXT_SCHEMES, REMAT_POLICIES, Candidate
from spmd_train.analysis.plan.stages import pipeline_layers
from spmd_train.config.checks import check_config
from spmd_train.config.mesh_schema import MESH_AXES, AxisFactors
from spmd_train.config.schedule_facts import schedule_names
from spmd_train.config.schema import Config
from spmd_train.errors import ConfigError


class Scope(IntEnum):
    """How much of a label a decision depends on."""

    MESH = 0
    """The six axis sizes."""
    STRUCTURE = 1
    """Plus sequence parallelism, the context scheme and the pipeline schedule, virtual stages, microbatches."""
    ZERO = 2
    """Plus the ZeRO stage."""
    REMAT = 3
    """Plus the remat policy and the optimizer state's offload."""
    FULL = 4
    """Plus grad accumulation and the slow-link factors."""


def canonical(c: Candidate) -> Candidate:
    """`c` with the settings its mesh makes irrelevant set to their defaults (the label's equality)."""
    fields: dict[str, Any] = {}
    if c.tensor == 1:
        fields["sequence_parallel"] = False
    if c.sequence == 1:
        fields["context_parallel"] = "allgather"
    if c.pipeline == 1:
        fields.update(pipeline_schedule="1f1b", pipeline_microbatches=None, virtual_stages=1)
    if c.fsdp * c.sequence == 1:
        fields["zero_stage"] = 0  # no ZeRO axis: every stage is the same program
    return dataclasses.replace(c, **fields) if any(getattr(c, k) != v for k, v in fields.items()) else c


def label(c: Candidate, scope: Scope = Scope.FULL) -> str:
    """The canonical label of `c`, cut at `scope`."""
    mesh = " ".join(f"{a}={n}" for a, n in zip(MESH_AXES, c.sizes, strict=True) if n > 1) or "devices=1"
    opts = []
    if scope >= Scope.ZERO:
        opts.append(f"zero{0 if c.fsdp * c.sequence == 1 else c.zero_stage}")
    if scope >= Scope.REMAT:
        opts.append(f"remat={c.remat}")
        if c.offload:
            opts.append("offload" if c.offload == 1 else f"offload={c.offload:g}")
    if scope >= Scope.STRUCTURE:
        if c.tensor > 1 and c.sequence_parallel:
            opts.append("sp")
        if c.sequence > 1:
            opts.append(f"cp={c.context_parallel}")
        if c.pipeline > 1:
            opts.append(f"pp={c.pipeline_schedule}")
            if c.virtual_stages > 1:
                opts.append(f"v={c.virtual_stages}")
            opts.append(f"m={c.pipeline_microbatches or 'default'}")
    if scope >= Scope.FULL and c.grad_accum > 1:
        opts.append(f"accum={c.grad_accum}")
    parts = [mesh, " ".join(opts)] if opts else [mesh]
    if scope >= Scope.FULL and any(f > 1 for f in c.dcn):
        parts.append("dcn " + " ".join(f"{a}={f}" for a, f in zip(MESH_AXES, c.dcn, strict=True) if f > 1))
    return " | ".join(parts)


def scoped(c: Candidate, scope: Scope) -> Candidate:
    """`c` with every setting beyond `scope` at its default: the key a decision at that scope is recorded under."""
    if scope == Scope.FULL:
        return c
    fields: dict[str, Any] = {"grad_accum": 1, "dcn": (1,) * len(MESH_AXES)}
    if scope < Scope.REMAT:
        fields.update(remat="none", offload=0.0)
    if scope < Scope.ZERO:
        fields["zero_stage"] = 3
    if scope < Scope.STRUCTURE:
        fields.update(sequence_parallel=False, context_parallel="allgather", pipeline_schedule="1f1b",
                      pipeline_microbatches=None, virtual_stages=1)
    return dataclasses.replace(c, **fields)


def parse_label(text: str) -> Candidate:
    """The candidate a label names (ConfigError naming the token that is not part of a label)."""
    return label_parts(text)[0]


def label_parts(text: str) -> tuple[Candidate, frozenset[str]]:
    """The candidate a label names, and the `Candidate` fields it gave (the rest are at their defaults)."""
    sizes, dcn, fields = {}, {}, {}
    for i, part in enumerate(p.strip() for p in text.split("|")):
        tokens = part.split()
        slow = bool(tokens) and tokens[0] == "dcn" and i > 0
        for token in tokens[1:] if slow else tokens:
            key, _, value = token.partition("=")
            try:
                _read(token, key, value, dcn if slow else sizes, fields)
            except ValueError:
                raise ConfigError(f"--explain {text!r}: {token!r} is not part of a layout label (valid tokens: "
                                  f"AXIS=N for {', '.join(MESH_AXES)}, zero0-3, remat={'|'.join(REMAT_POLICIES)}, "
                                  "offload or offload=SHARE, sp, "
                                  f"cp={'|'.join(CONTEXT_SCHEMES)}, pp={'|'.join(schedule_names())}, v=N, m=N, "
                                  "accum=N, and '| dcn AXIS=N ...'; e.g. 'fsdp=32 tensor=8 | zero3 remat=full')"
                                  ) from None
    sizes.pop("devices", None)
    return canonical(Candidate(**sizes, **fields, dcn=dcn)), frozenset(fields)


def _read(token: str, key: str, value: str, sizes: dict, fields: dict) -> None:
    """One token into axis sizes or candidate fields; ValueError when it is none of them."""
    if key in (*MESH_AXES, "devices") and value.isdigit():
        sizes[key] = int(value)
    elif not value and key in ("zero0", "zero1", "zero2", "zero3"):
        fields["zero_stage"] = int(key[-1])
    elif not value and key == "sp":
        fields["sequence_parallel"] = True
    elif key == "remat" and value in REMAT_POLICIES:
        fields["remat"] = value
    elif key == "offload" and (not value or _share(value)):
        fields["offload"] = float(value or 1)
    elif key == "cp" and value in CONTEXT_SCHEMES:
        fields["context_parallel"] = value
    elif key == "pp" and value in schedule_names():
        fields["pipeline_schedule"] = value
    elif key in ("v", "m", "accum") and value.isdigit() and int(value) > 0:
        fields[{"v": "virtual_stages", "m": "pipeline_microbatches", "accum": "grad_accum"}[key]] = int(value)
    elif key == "m" and value == "default":
        fields["pipeline_microbatches"] = None
    else:
        raise ValueError(token)


def _share(value: str) -> bool:
    try:
        return 0 < float(value) <= 1
    except ValueError:
        return False


def offload_value(share: float) -> bool | float:
    """offload.optimizer's value for a share of the state: false, true or the fraction."""
    return share if 0 < share < 1 else bool(share)


def overrides(c: Candidate, rows: int | None = None) -> list[str]:
    """The `section.key=value` overrides that make a base config run candidate `c` (`rows`: the model's stack rows,
    `ModelConfig.stack_rows`, which decide whether uneven stages need parallel.pipeline_layers=balanced)."""
    layers = None if rows is None else pipeline_layers(rows, c)
    out = [f"mesh.{a}={n}" for a, n in zip(MESH_AXES, c.sizes, strict=True)]
    out += [f"mesh.dcn.{a}={f}" for a, f in zip(MESH_AXES, c.dcn, strict=True)]
    micro = "null" if c.pipeline_microbatches is None else c.pipeline_microbatches
    return [*out, f"parallel.zero_stage={c.zero_stage}", f"parallel.remat={c.remat}",
            f"parallel.sequence_parallel={str(c.sequence_parallel).lower()}",
            f"parallel.context_parallel={c.context_parallel}", f"parallel.pipeline_schedule={c.pipeline_schedule}",
            f"parallel.pipeline_microbatches={micro}", f"parallel.virtual_stages={c.virtual_stages}",
            f"parallel.pipeline_layers={layers or 'null'}", f"train.grad_accum={c.grad_accum}",
            f"offload.optimizer={str(offload_value(c.offload)).lower()}"]


def config_dict(cfg: Config, c: Candidate) -> dict[str, Any]:
    """The whole config `cfg` with candidate `c`'s layout, as plain YAML-ready data (every key explicit)."""
    raw = _plain(dataclasses.asdict(cfg))
    # Every key is explicit, so the presets would add nothing (and a preset given as a relative path would not be
    # found from elsewhere); a checkpoint's model section is compared without its preset name.
    raw["model"]["preset"] = raw["mesh"]["preset"] = None
    raw["mesh"].update(zip(MESH_AXES, c.sizes, strict=True))
    raw["mesh"]["dcn"] = dict(zip(MESH_AXES, c.dcn, strict=True))
    raw["parallel"].update(zero_stage=c.zero_stage, remat=c.remat, sequence_parallel=c.sequence_parallel,
                           context_parallel=c.context_parallel, pipeline_schedule=c.pipeline_schedule,
                           pipeline_microbatches=c.pipeline_microbatches, virtual_stages=c.virtual_stages,
                           pipeline_layers=pipeline_layers(cfg.model.stack_rows, c))
    raw["train"]["grad_accum"] = c.grad_accum
    raw["offload"]["optimizer"] = offload_value(c.offload)
    return raw


def config_for(cfg: Config, c: Candidate) -> Config:
    """`cfg` running candidate `c`: the layout's keys replaced (their values are the ones `Candidate` validated), then
    the cross-key checks a loaded config gets (`config.checks.check_config`)."""
    sizes = dict(zip(MESH_AXES, c.sizes, strict=True))
    mesh = dataclasses.replace(cfg.mesh, **sizes, dcn=AxisFactors(**dict(zip(MESH_AXES, c.dcn, strict=True))))
    parallel = dataclasses.replace(cfg.parallel, zero_stage=c.zero_stage, remat=c.remat,
                                   sequence_parallel=c.sequence_parallel, context_parallel=c.context_parallel,
                                   pipeline_schedule=c.pipeline_schedule,
                                   pipeline_microbatches=c.pipeline_microbatches, virtual_stages=c.virtual_stages,
                                   pipeline_layers=pipeline_layers(cfg.model.stack_rows, c))
    out = dataclasses.replace(cfg, mesh=mesh, parallel=parallel,
                              train=dataclasses.replace(cfg.train, grad_accum=c.grad_accum),
                              offload=dataclasses.replace(cfg.offload, optimizer=offload_value(c.offload)))
    check_config(out)
    return out


def _plain(value: Any) -> Any:
    """Tuples as lists, recursively: what YAML and the loader read back as the same config."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value

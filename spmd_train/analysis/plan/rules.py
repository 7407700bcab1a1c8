"""Which layouts the config checks refuse, as short stable reasons, without building a config per candidate.

Mirrored from `config.checks.check_layout` (tensor splits the heads, K/V heads, d_ff, the vocabulary
and each expert's d_ff; the batch axes and grad_accum divide the global batch; sequence, times tensor
under sequence parallelism, divides the length; ring needs 2 x sequence chunks, ulysses whole query
heads per device, and cuDNN cannot merge context-parallel blocks), `check_moe` (expert divides the
experts), `parallel.schedules.check_pipeline` (stages x virtual stages divide the layers, the
microbatches divide a device's rows, whole MoE groups per stage) and `sharding.rules.Layout` (from ZeRO-1
on, the state's `embed` dimension, d_model, is split over fsdp x sequence). The search runs the real
checks too on what it ranks first (`real_check`), and tests/test_plan_search.py holds the mirror to
`Engine.build`. A rejection's `rule` is stable (model constants only) so rejections can be counted per
rule; its `detail` names this candidate's values.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from spmd_train.analysis.plan.candidate import ACTIVATION_RULES, PARAM_RULES, Candidate
from spmd_train.analysis.plan.devices import SLOW_AXES, Target, slow_placements
from spmd_train.analysis.plan.labels import Scope, label
from spmd_train.analysis.plan.shape import ModelShape
from spmd_train.config.checks import check_layout
from spmd_train.config.schema import MESH_AXES, Config
from spmd_train.errors import ConfigError
from spmd_train.parallel.schedules import check_pipeline

FIT = "does not fit in HBM"
REFUSED = "refused by the config checks"


@dataclass(frozen=True)
class Rejection:
    """Why a candidate (or every candidate under a scope) is not ranked."""

    candidate: Candidate
    """The candidate, its settings beyond `scope` at their defaults (`labels.scoped`)."""
    scope: Scope
    """Where it was decided: a mesh refused for divisibility stands for every setting on it."""
    rule: str
    """Stable text to count by, e.g. "tensor does not divide num_kv_heads=8"."""
    detail: str
    """This candidate's case, e.g. "tensor=16: tensor does not divide num_kv_heads=8"."""
    kind: str
    """invalid (the config checks refuse it), redundant (valid, and the same as a simpler layout), placement (the
    slow link cannot be placed), memory (does not fit) or dominated (another candidate is never slower)."""
    accums: tuple[int, ...] = ()
    """At the remat scope, the grad accumulations this rejection covers (a group of them)."""
    peak: float | None = None
    """The least estimated peak bytes per device among what a memory rejection covers."""

    @property
    def count(self) -> int:
        """Candidates it stands for: 1, or the accumulations of a group."""
        return len(self.accums) or 1

    @property
    def label(self) -> str:
        """The candidate's label at its scope (with `accum=A..B` for a group of accumulations)."""
        text = label(self.candidate, self.scope)
        if self.accums:
            span = f"accum={self.accums[0]}" + (f"..{self.accums[-1]}" if len(self.accums) > 1 else "")
            text += f" {span}"
        return text


def factorizations(n: int, parts: int = len(MESH_AXES)) -> Iterator[tuple[int, ...]]:
    """Every ordered tuple of `parts` positive integers whose product is `n`, in lexicographic order."""
    if parts == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in factorizations(n // d, parts - 1):
                yield (d, *rest)


def check_default_rules(cfg: Config) -> None:
    """ConfigError unless `cfg` uses the default sharding rules, the only ones the analytic model knows."""
    rules = cfg.mesh.rules
    if rules.activations != ACTIVATION_RULES or {**rules.activations, **rules.params} != PARAM_RULES:
        raise ConfigError("plan knows the default sharding rules only (mesh.rules.preset=default without entries of "
                          f"its own); this config has mesh.rules.preset={rules.preset}, activations "
                          f"{dict(rules.activations)}, params {dict(rules.params)}")


def mesh_reason(cfg: Config, shape: ModelShape, c: Candidate, target: Target) -> Rejection | None:
    """Why no candidate on this mesh can run, or None."""
    m, t, where = cfg.model, cfg.train, (c, Scope.MESH)
    splits = [("num_heads", m.num_heads), ("num_kv_heads", m.num_kv_heads), ("d_ff", m.d_ff),
              ("vocab_size", m.vocab_size)] + ([("moe.d_ff", m.resolved_moe_d_ff)] if m.moe else [])
    for key, value in splits:
        if value % c.tensor:
            return _invalid(where, f"tensor does not divide {key}={value}", f"tensor={c.tensor}")
    if m.moe is not None and m.moe.num_experts % c.expert:
        return _invalid(where, f"expert does not divide num_experts={m.moe.num_experts}", f"expert={c.expert}")
    if m.num_layers % c.pipeline:
        return _invalid(where, f"pipeline does not divide num_layers={m.num_layers}", f"pipeline={c.pipeline}")
    if t.global_batch_size % c.batch_ways:
        return _invalid(where, f"data x fsdp x expert does not divide global_batch_size={t.global_batch_size}",
                        f"data x fsdp x expert = {c.batch_ways}")
    if t.seq_len % c.sequence:
        return _invalid(where, f"sequence does not divide seq_len={t.seq_len}", f"sequence={c.sequence}")
    if target.domains > 1 and not slow_placements(c.sizes, target.domains):
        outer = math.prod(c.shape[a] for a in SLOW_AXES)
        return Rejection(*where, f"the outer axes cannot span the {target.domains} fast-link domains",
                         f"{' x '.join(SLOW_AXES)} = {outer} cannot take {target.domains} slow-link factors (the "
                         f"inner axes would cross the slow link)", "placement")
    return None


def structure_reason(cfg: Config, shape: ModelShape, c: Candidate) -> Rejection | None:
    """Why this sequence-parallel, context and pipeline setting cannot run on its mesh, or None (`c` at that scope,
    `labels.scoped`)."""
    m, t, where = cfg.model, cfg.train, (c, Scope.STRUCTURE)
    if c.sequence_parallel and t.seq_len % (c.sequence * c.tensor):
        return _invalid(where, f"sequence x tensor does not divide seq_len={t.seq_len} (sequence parallelism)",
                        f"sequence x tensor = {c.sequence * c.tensor}")
    if c.sequence > 1:
        if c.context_parallel == "ring" and c.pipeline > 1:
            return _invalid(where, "ring attention inside a pipeline stage computes wrong values (config checks)",
                            f"cp=ring, pipeline={c.pipeline}")
        if c.context_parallel == "ring" and t.seq_len % (2 * c.sequence):
            return _invalid(where, f"ring: 2 x sequence does not divide seq_len={t.seq_len}",
                            f"2 x sequence = {2 * c.sequence}")
        heads = m.num_heads // c.tensor
        if c.context_parallel == "ulysses" and heads % c.sequence:
            return _invalid(where, "ulysses: sequence does not divide the query heads per tensor shard",
                            f"sequence={c.sequence}, {heads} heads per tensor shard")
        if c.context_parallel != "ulysses" and cfg.backends.attention == "cudnn":
            return _invalid(where, "backends.attention=cudnn cannot merge context-parallel blocks",
                            f"cp={c.context_parallel}")
    if c.pipeline > 1:
        chunks = c.pipeline * c.virtual_stages
        if m.num_layers % chunks:
            return _invalid(where, f"pipeline x virtual does not divide num_layers={m.num_layers}",
                            f"pipeline x virtual = {chunks}")
        if m.moe_every > 1 and (m.num_layers // chunks) % m.moe_every:
            return _invalid(where, f"a stage chunk's layers would split an MoE group of moe.every={m.moe_every}",
                            f"pipeline x virtual = {chunks}")
        rows = t.global_batch_size // c.batch_ways
        if rows % c.pipeline_microbatches:
            return _invalid(where, "pipeline microbatches do not divide the rows per device",
                            f"m={c.pipeline_microbatches}, {rows} rows per device")
    return None


def zero_reason(shape: ModelShape, c: Candidate) -> Rejection | None:
    """Why this ZeRO stage cannot shard the state on its mesh, or None (`c` at that scope, `labels.scoped`)."""
    ways = c.fsdp * c.sequence
    if c.zero_stage >= 1 and shape.d_model % ways:
        return _invalid((c, Scope.ZERO), f"fsdp x sequence does not divide d_model={shape.d_model} (ZeRO-1+)",
                        f"fsdp x sequence = {ways}")
    return None


def redundant_reason(cfg: Config, c: Candidate) -> Rejection | None:
    """A valid layout that runs what a simpler one runs, or None (`c` at the ZeRO scope: asked only once every
    divisibility rule passed, so that a refusal always names why the layout cannot run when it cannot)."""
    if cfg.model.moe is None and c.expert > 1:
        return Rejection(c, Scope.ZERO, "expert axis without MoE layers (a replica axis, as data)",
                         f"expert={c.expert} on a dense model only replicates, as data={c.expert} would", "redundant")
    return None


def real_check(cfg: Config, c: Candidate, platform: str) -> Rejection | None:
    """The config checks themselves on `cfg` (the candidate's config): a rejection with their message, or None."""
    try:
        check_layout(cfg, c.shape, platform)
        if c.pipeline > 1:
            check_pipeline(cfg, c.shape, cfg.train.global_batch_size // (c.grad_accum * c.batch_ways))
    except ConfigError as err:
        return Rejection(c, Scope.FULL, REFUSED, str(err), "invalid")
    return None


def _invalid(where: tuple[Candidate, Scope], rule: str, values: str) -> Rejection:
    return Rejection(*where, rule, f"{values}: {rule}", "invalid")

"""Which layouts the config checks refuse, as short stable reasons, without building a config per candidate.

Each rule is `config.validity`'s, the predicate the config checks raise on (`config.checks.check_layout`, `check_moe`,
`check_context`, `config.pipeline_keys.check_pipeline`); here a broken one becomes a `Rejection` with the rule's
stable text, at the scope where the rule's numbers are all known (the mesh, then the structure). Only the ZeRO split
of d_model is this module's own: the config refuses it through `sharding.layout.Layout`'s split of any dimension,
which needs a mesh. The search runs the real checks too on what it ranks first (`real_check`), and
tests/test_plan_search.py holds the two equal over a grid, and the ZeRO rule to `Engine.build`. A rejection's `rule`
is stable (model constants only) so rejections can be counted per rule; its `detail` names this candidate's values.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

from spmd_train.analysis.plan.candidate import Candidate
from spmd_train.analysis.plan.labels import Scope, label
from spmd_train.analysis.plan.shape import ModelShape
from spmd_train.analysis.plan.target import SLOW_AXES, Target, slow_placements
from spmd_train.config.checks import check_layout
from spmd_train.config.load import default_rules
from spmd_train.config.mesh_schema import MESH_AXES, ZERO_AXES
from spmd_train.config.model_schema import ModelConfig
from spmd_train.config.pipeline_keys import check_pipeline
from spmd_train.config.resolved_rules import RuleTables
from spmd_train.config.schedule_facts import schedule_facts
from spmd_train.config.schema import Config
from spmd_train.config.validity import (
    Violation,
    attention_merges_no_blocks,
    axes_divide_tokens,
    batch_axes_divide_batch,
    chunks_divide_layers,
    chunks_fit_layers,
    chunks_hold_moe_groups,
    expert_divides_experts,
    microbatches_divide_rows,
    mtp_outside_pipeline,
    ring_outside_pipeline,
    ring_zigzag_chunks,
    tensor_divides,
    ulysses_whole_heads,
    virtual_stages_fit,
)
from spmd_train.errors import ConfigError

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
    if RuleTables.from_config(rules) != default_rules():
        raise ConfigError("plan knows the default sharding rules only (mesh.rules.preset=default without entries of "
                          f"its own); this config has mesh.rules.preset={rules.preset}, activations "
                          f"{dict(rules.activations)}, params {dict(rules.params)}")


def mesh_reason(cfg: Config, shape: ModelShape, c: Candidate, target: Target) -> Rejection | None:
    """Why no candidate on this mesh can run, or None."""
    m, t = cfg.model, cfg.train
    splits = [("num_heads", m.num_heads), ("num_kv_heads", m.num_kv_heads), ("d_ff", m.d_ff),
              ("vocab_size", m.vocab_size)] + ([("moe.d_ff", m.resolved_moe_d_ff)] if m.moe else [])
    found = (next((v for key, value in splits if (v := tensor_divides(key, value, c.tensor))), None)
             or (expert_divides_experts(m.moe.num_experts, c.expert) if m.moe is not None else None)
             # Every virtual-stage count needs at least as many of the stack's rows as the stages alone.
             or chunks_fit_layers(m.num_layers, m.moe_every, c.pipeline, 1, m.first_dense)
             or batch_axes_divide_batch(t.global_batch_size, {a: c.shape[a] for a in c.tables.batch_axes})
             or axes_divide_tokens(t.seq_len, c.sequence, c.tensor, sequence_parallel=False))
    if found is not None:
        return _invalid((c, Scope.MESH), found)
    if target.domains > 1 and not slow_placements(c.sizes, target.domains):
        outer = math.prod(c.shape[a] for a in SLOW_AXES)
        return Rejection(c, Scope.MESH, f"the outer axes cannot span the {target.domains} fast-link domains",
                         f"{' x '.join(SLOW_AXES)} = {outer} cannot take {target.domains} slow-link factors (the "
                         f"inner axes would cross the slow link)", "placement")
    return None


def structure_reason(cfg: Config, shape: ModelShape, c: Candidate) -> Rejection | None:
    """Why this sequence-parallel, context and pipeline setting cannot run on its mesh, or None (`c` at that scope,
    `labels.scoped`)."""
    m, t, cp = cfg.model, cfg.train, c.context_parallel
    found = (axes_divide_tokens(t.seq_len, c.sequence, c.tensor, c.sequence_parallel)
             or ring_outside_pipeline(cp, c.sequence, c.pipeline)
             or ring_zigzag_chunks(cp, t.seq_len, c.sequence)
             or ulysses_whole_heads(cp, m.num_heads, c.tensor, c.sequence)
             or attention_merges_no_blocks(cp, cfg.backends.attention, c.sequence))
    if found is None and c.pipeline > 1:
        rows = t.global_batch_size // c.batch_ways
        found = (virtual_stages_fit(c.pipeline_schedule, c.virtual_stages)
                 or _stage_chunks(m, c)
                 or mtp_outside_pipeline(0 if m.mtp is None else m.mtp.depth, c.pipeline)
                 or microbatches_divide_rows(c.pipeline_microbatches, rows, t.global_batch_size, 1))
    return None if found is None else _invalid((c, Scope.STRUCTURE), found)


def _stage_chunks(m: ModelConfig, c: Candidate) -> Violation | None:
    """Stage chunks the engine can lay out: equal ones for split-backward schedules (their B and W cannot split a
    padded chunk), else as many as the stack has rows (uneven ones run parallel.pipeline_layers=balanced)."""
    if schedule_facts(c.pipeline_schedule).split_backward:
        return (chunks_divide_layers(m.num_layers, c.pipeline, c.virtual_stages, first_dense=m.first_dense)
                or chunks_hold_moe_groups(m.num_layers, m.moe_every, c.pipeline, c.virtual_stages, m.first_dense))
    return chunks_fit_layers(m.num_layers, m.moe_every, c.pipeline, c.virtual_stages, m.first_dense)


WIDTH_KEYS = {"embed": "d_model", "q_lora_in": "mla.q_lora_rank", "kv_lora_in": "mla.kv_lora_rank"}
"""The model key behind a logical axis the ZeRO axes split, for the rule's text."""


def zero_reason(shape: ModelShape, c: Candidate) -> Rejection | None:
    """Why this ZeRO stage cannot shard the state on its mesh, or None (`c` at that scope, `labels.scoped`)."""
    ways = c.fsdp * c.sequence
    if c.zero_stage == 0 or ways == 1:
        return None
    for name, size in _zero_widths(shape, c.rules):
        if size % ways:
            rule = f"fsdp x sequence does not divide {WIDTH_KEYS.get(name, name)}={size} (ZeRO-1+)"
            return Rejection(c, Scope.ZERO, rule, f"fsdp x sequence = {ways}: {rule}", "invalid")
    return None


@functools.lru_cache(maxsize=64)
def _zero_widths(shape: ModelShape, rules: RuleTables | None) -> tuple[tuple[str, int], ...]:
    """(logical axis, size) of every parameter dimension the rules put on the ZeRO axes: `embed` (d_model) and MLA's
    latent rows. (The rules map each name to both ZERO_AXES or to neither; `check_default_rules` keeps it so.)"""
    params = (rules or default_rules()).resolve(sequence_parallel=False, pipeline=1).params
    found = {axis: size for g in shape.params for size, axis in zip(g.shape, g.axes, strict=True)
             if set(params.get(axis, ())) & set(ZERO_AXES)}
    return tuple(found.items())


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


def _invalid(where: tuple[Candidate, Scope], found: Violation) -> Rejection:
    return Rejection(*where, found.rule, found.detail, "invalid")

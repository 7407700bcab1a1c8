"""The layout rules, each defined once: a predicate of plain numbers that returns None or the `Violation` it finds.

Two callers read the same violation. The config checks (`config.checks`, `config.pipeline_keys`, and the schedule
builder `parallel.schedules.build_schedule`) raise its `message`, which names the keys, their values and what would be
valid. The planner (`analysis.plan.rejections`) records its `rule`, stable text built from model constants only so that
rejections can be counted per rule, and its `values`, the layout's numbers. The arguments are plain values, not
configs or meshes, so the planner can ask without building a config per candidate (and no jax is imported).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from spmd_train.config.attention_facts import attention_facts, attention_names
from spmd_train.config.schedule_facts import schedule_facts, schedule_names, spoken
from spmd_train.errors import ConfigError


@dataclass(frozen=True)
class Violation:
    """A broken layout rule, in the words of both callers."""

    rule: str
    """Stable text to count by (model constants only), e.g. "tensor does not divide num_kv_heads=8"."""
    values: str
    """This layout's numbers, e.g. "tensor=16"."""
    message: str
    """What the config checks raise: the keys, their values and what would be valid."""

    @property
    def detail(self) -> str:
        """The planner's line for this case: its values, then the rule."""
        return f"{self.values}: {self.rule}"


def refuse(found: Violation | None) -> None:
    """Raise `found`'s message as a ConfigError; nothing when the rule held (None)."""
    if found is not None:
        raise ConfigError(found.message)


def divisors(n: int) -> str:
    """The divisors of n, as a 'valid values' list for error messages (described, not listed, past 10**12)."""
    if n > 10**12:  # trial division up to sqrt(n) would take minutes (model.num_layers=2147483647 did hang)
        return f"a divisor of {n}"
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return ", ".join(str(d) for d in sorted({*low, *(n // d for d in low)}))


# --- mesh axes against the model and the batch ---------------------------------------------------------------------


def tensor_divides(key: str, value: int, tensor: int) -> Violation | None:
    """mesh.tensor divides model.`key` (num_heads, num_kv_heads, d_ff, vocab_size or moe.d_ff), which it splits."""
    if value % tensor == 0:
        return None
    why = "each expert's hidden width" if key == "moe.d_ff" else f"it across {tensor} devices"
    return Violation(f"tensor does not divide {key}={value}", f"tensor={tensor}",
                     f"model.{key}={value} is not divisible by mesh.tensor={tensor}: tensor parallelism splits {why} "
                     f"(valid mesh.tensor: {divisors(value)})")


def expert_divides_experts(num_experts: int, expert: int) -> Violation | None:
    """mesh.expert divides model.moe.num_experts: each device of the expert axis holds an equal share."""
    if num_experts % expert == 0:
        return None
    return Violation(f"expert does not divide num_experts={num_experts}", f"expert={expert}",
                     f"model.moe.num_experts={num_experts} is not divisible by mesh.expert={expert}: each device of "
                     f"the expert axis holds num_experts / mesh.expert experts (valid mesh.expert: "
                     f"{divisors(num_experts)})")


def batch_axes_divide_batch(global_batch_size: int, axes: Mapping[str, int], grad_accum: int = 1) -> Violation | None:
    """The batch axes (`axes`: name -> size, in rule order) times train.grad_accum divide train.global_batch_size."""
    need = math.prod(axes.values()) * grad_accum
    if global_batch_size % need == 0:
        return None
    names = " x ".join([*axes, *(["grad_accum"] if grad_accum > 1 else [])])
    return Violation(f"{names} does not divide global_batch_size={global_batch_size}", f"{names} = {need}",
                     f"train.global_batch_size={global_batch_size} is not divisible by "
                     f"{' x '.join(f'mesh.{a}={n}' for a, n in axes.items())} x train.grad_accum={grad_accum} = "
                     f"{need}: each device needs a whole share of every microbatch (valid: a multiple of {need})")


def axes_divide_tokens(seq_len: int, sequence: int, tensor: int, sequence_parallel: bool) -> Violation | None:
    """mesh.sequence, times mesh.tensor under sequence parallelism, divides train.seq_len: they split the tokens."""
    ways = sequence * (tensor if sequence_parallel else 1)
    if seq_len % ways == 0:
        return None
    why = f"mesh.sequence={sequence}" + (f" x mesh.tensor={tensor} (parallel.sequence_parallel=true)"
                                         if sequence_parallel else "")
    message = (f"train.seq_len={seq_len} is not divisible by {why} = {ways}: tokens are split over these axes "
               f"(valid: a multiple of {ways})")
    if sequence_parallel:
        return Violation(f"sequence x tensor does not divide seq_len={seq_len} (sequence parallelism)",
                         f"sequence x tensor = {ways}", message)
    return Violation(f"sequence does not divide seq_len={seq_len}", f"sequence={sequence}", message)


# --- context parallelism (mesh.sequence > 1) ------------------------------------------------------------------------


def ring_outside_pipeline(context_parallel: str, sequence: int, pipeline: int) -> Violation | None:
    """Ring attention runs without pipeline stages."""
    if context_parallel != "ring" or sequence == 1 or pipeline == 1:
        return None
    return Violation("ring attention inside a pipeline stage computes wrong values (config checks)",
                     f"cp=ring, pipeline={pipeline}",
                     f"parallel.context_parallel=ring with mesh.pipeline={pipeline}: ring attention's permutes would "
                     "run inside the pipeline's per-tick branch, which stages take differently at one tick, and the "
                     "step computes wrong values (NaN on 8 CPU devices; found by the planner's check) (valid: "
                     "parallel.context_parallel=allgather or ulysses with a pipeline, or mesh.pipeline=1 for ring)")


def ring_zigzag_chunks(context_parallel: str, seq_len: int, sequence: int) -> Violation | None:
    """Ring attention's zigzag layout: 2 x mesh.sequence divides train.seq_len."""
    if context_parallel != "ring" or sequence == 1 or seq_len % (2 * sequence) == 0:
        return None
    return Violation(f"ring: 2 x sequence does not divide seq_len={seq_len}", f"2 x sequence = {2 * sequence}",
                     f"train.seq_len={seq_len} with parallel.context_parallel=ring over mesh.sequence={sequence}: the "
                     f"zigzag layout gives each device 2 of {2 * sequence} equal chunks (valid: a multiple of "
                     f"{2 * sequence}, or parallel.context_parallel=allgather)")


def ulysses_whole_heads(context_parallel: str, num_heads: int, tensor: int, sequence: int) -> Violation | None:
    """Ulysses: mesh.sequence divides the query heads on a tensor shard (num_heads / mesh.tensor)."""
    heads = num_heads // tensor
    if context_parallel != "ulysses" or sequence == 1 or heads % sequence == 0:
        return None
    return Violation("ulysses: sequence does not divide the query heads per tensor shard",
                     f"sequence={sequence}, {heads} heads per tensor shard",
                     f"parallel.context_parallel=ulysses with mesh.sequence={sequence} needs the query heads on a "
                     f"device (model.num_heads={num_heads} / mesh.tensor={tensor} = {heads}) to divide by {sequence} "
                     f"(valid mesh.sequence: {divisors(heads)}); parallel.context_parallel=ring or allgather has no "
                     "such limit")


def attention_merges_no_blocks(context_parallel: str, attention: str, sequence: int) -> Violation | None:
    """allgather and ring merge blocks by log-sum-exp: an attention implementation that returns none runs only
    under ulysses (`AttentionFacts.returns_lse`)."""
    facts = attention_facts(attention) if attention in attention_names() else None  # "auto" resolves to one that can
    if context_parallel not in ("allgather", "ring") or facts is None or facts.returns_lse or sequence == 1:
        return None
    merging = tuple(n for n in attention_names() if attention_facts(n).returns_lse)
    return Violation(f"backends.attention={attention} cannot merge context-parallel blocks", f"cp={context_parallel}",
                     f"backends.attention={attention} with parallel.context_parallel={context_parallel}: the blocks' "
                     f"results are merged by log-sum-exp, which {facts.label} does not return (valid: "
                     f"backends.attention={', '.join(merging)} or auto, or parallel.context_parallel=ulysses)")


# --- pipeline stages (mesh.pipeline > 1) ----------------------------------------------------------------------------


def virtual_stages_fit(schedule: str, virtual: int) -> Violation | None:
    """parallel.virtual_stages suits the schedule (`ScheduleFacts.min_virtual`/`max_virtual`): >= 2 for
    interleaved_1f1b, exactly 2 for zb_v, else 1."""
    facts = schedule_facts(schedule)
    low, high = facts.min_virtual, facts.max_virtual
    if low <= virtual and (high is None or virtual <= high):
        return None
    if high == 1:
        several = spoken(tuple(n for n in schedule_names() if schedule_facts(n).max_virtual != 1))
        return Violation(f"{schedule} runs one chunk per stage", f"virtual={virtual}",
                         f"parallel.virtual_stages={virtual} is invalid for parallel.pipeline_schedule={schedule}: "
                         f"only {several} run several chunks per stage (valid: 1)")
    valid = f"={low}" if high == low else f" >= {low}" if high is None else f" in {low}..{high}"
    why = facts.virtual_refusal or f" (valid: parallel.virtual_stages{valid})"
    return Violation(f"{schedule} needs virtual_stages{valid}", f"virtual={virtual}",
                     f"parallel.virtual_stages={virtual} is invalid with parallel.pipeline_schedule={schedule}{why}")


def microbatches_fit(schedule: str, stages: int, microbatches: int) -> Violation | None:
    """parallel.pipeline_microbatches suits the schedule: >= stages to fill 1F1B-like warm-ups (`ScheduleFacts.fill`),
    groups of stages when interleaved (`ScheduleFacts.groups`)."""
    facts = schedule_facts(schedule)
    if facts.fill and microbatches < stages:
        return Violation(f"{schedule} needs microbatches >= pipeline", f"m={microbatches}, pipeline={stages}",
                         f"parallel.pipeline_microbatches={microbatches} is invalid for parallel.pipeline_schedule="
                         f"{schedule} with mesh.pipeline={stages}: {facts.fill} (valid: >= {stages})")
    if facts.groups and microbatches % stages:
        return Violation(f"{schedule} needs microbatches in groups of pipeline",
                         f"m={microbatches}, pipeline={stages}",
                         f"parallel.pipeline_microbatches={microbatches} is not divisible by mesh.pipeline={stages}: "
                         f"{schedule} runs microbatches in groups of {stages} (valid: a multiple of {stages})")
    return None


_COUNTS = {"mesh.pipeline": "pipeline stages", "parallel.pipeline_microbatches": "microbatches per step",
           "parallel.virtual_stages": "model chunks per stage"}


def schedule_request(name: str, stages: object, microbatches: object, virtual: object) -> Violation | None:
    """A schedule the builder can lay out: a known name, counts that are integers >= 1, and the chunks and
    microbatches that schedule needs (`virtual_stages_fit`, `microbatches_fit`)."""
    if name not in schedule_names():
        return Violation("not a pipeline schedule", f"schedule={name!r}",
                         f"parallel.pipeline_schedule={name!r} is not a pipeline schedule "
                         f"(valid: {', '.join(schedule_names())})")
    for key, value in (("mesh.pipeline", stages), ("parallel.pipeline_microbatches", microbatches),
                       ("parallel.virtual_stages", virtual)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return Violation(f"{key} is not a count", f"{key}={value!r}",
                             f"{key}={value!r} is invalid: it counts {_COUNTS[key]} (valid: an integer >= 1)")
    return virtual_stages_fit(name, virtual) or microbatches_fit(name, stages, microbatches)


def staged_layers(num_layers: int, first_dense: int = 0) -> tuple[int, str]:
    """(the layers pipeline stages hold, how messages name them): model.num_layers less the model.moe.first_k_dense
    dense layers, which run before the stages (`train.pipelined`)."""
    if not first_dense:
        return num_layers, f"model.num_layers={num_layers}"
    layers = num_layers - first_dense
    return layers, f"the {layers} layers after model.moe.first_k_dense={first_dense} (model.num_layers={num_layers})"


def chunks_divide_layers(num_layers: int, pipeline: int, virtual: int, *, preset: str | None = None,
                         pipeline_layers: object = None, schedule: str = "1f1b",
                         first_dense: int = 0) -> Violation | None:
    """Equal stage chunks: mesh.pipeline x parallel.virtual_stages divides the staged layers (model.num_layers less
    any first_dense ones; `preset`, `pipeline_layers` and `schedule` only word the way out)."""
    chunks = pipeline * virtual
    layers, named = staged_layers(num_layers, first_dense)
    if layers % chunks == 0:
        return None
    preset_note = "" if preset is None else f", not preset {preset!r} as is"
    message = (f"{named} {'is' if not first_dense else 'are'} not divisible by mesh.pipeline={pipeline} x "
               f"parallel.virtual_stages={virtual} = {chunks}: every stage{' chunk' if virtual > 1 else ''} gets the "
               f"same number of layers (valid: a model with a multiple of {chunks} layers{preset_note}, or "
               f"mesh.pipeline x virtual_stages in {divisors(layers)}"
               + (", or parallel.pipeline_layers=balanced or a list of layer counts)" if pipeline_layers is None
                  else f"; parallel.pipeline_schedule={schedule} runs equal stage chunks only)"))
    what = f"num_layers={layers}" if not first_dense else f"the {layers} layers after first_k_dense"
    if virtual == 1:
        return Violation(f"pipeline does not divide {what}", f"pipeline={pipeline}", message)
    return Violation(f"pipeline x virtual does not divide {what}", f"pipeline x virtual = {chunks}", message)


def mtp_outside_pipeline(depth: int, pipeline: int) -> Violation | None:
    """model.mtp's modules run after the trunk on the last stage's output: not yet under a pipeline."""
    if depth == 0 or pipeline == 1:
        return None
    return _not_pipelined(f"model.mtp.depth={depth}", f"model.mtp (depth {depth})", pipeline,
                          "the multi-token prediction modules read the trunk's output and the embedding after the last "
                          "stage, which the pipeline schedules do not yet run", "model.mtp=null")


def _not_pipelined(key: str, what: str, pipeline: int, why: str, off: str) -> Violation:
    """A model part that pipeline stages do not yet run, refused with mesh.pipeline > 1."""
    return Violation(f"{key} with a pipeline", f"pipeline={pipeline}",
                     f"{what} with mesh.pipeline={pipeline}: {why} (valid: mesh.pipeline=1, or {off})")


def chunks_fit_layers(num_layers: int, moe_every: int, pipeline: int, virtual: int,
                      first_dense: int = 0) -> Violation | None:
    """Uneven stage chunks (parallel.pipeline_layers=balanced): every chunk gets at least one row of the stack (a
    layer, or an MoE group of moe.every layers)."""
    chunks, unit = pipeline * virtual, max(moe_every, 1)
    layers, named = staged_layers(num_layers, first_dense)
    if layers // unit >= chunks:
        return None
    where = f"mesh.pipeline={pipeline}" + (f" x parallel.virtual_stages={virtual}" if virtual > 1 else "")
    return Violation(f"fewer stack rows than stage chunks ({layers // unit})", f"pipeline x virtual = {chunks}",
                     f"parallel.pipeline_layers=balanced cannot fill {chunks} stage chunks ({where}) with {named}"
                     + (f" in groups of model.moe.every={unit}" if unit > 1 else "")
                     + f" (valid: at most {layers // unit} chunks)")


def chunks_hold_moe_groups(num_layers: int, moe_every: int, pipeline: int, virtual: int,
                           first_dense: int = 0) -> Violation | None:
    """Equal stage chunks hold whole MoE groups (model.moe.every layers, the stack's rows): moe.every divides a
    chunk's layers (of those after any first_dense ones)."""
    chunks = pipeline * virtual
    layers, named = staged_layers(num_layers, first_dense)
    depth = layers // chunks
    if moe_every <= 1 or depth % moe_every == 0:
        return None
    return Violation(f"a stage chunk's layers would split an MoE group of moe.every={moe_every}",
                     f"pipeline x virtual = {chunks}",
                     f"model.moe.every={moe_every} does not divide the {depth} layer{'s' * (depth > 1)} each pipeline "
                     f"stage{' chunk' if virtual > 1 else ''} holds ({named} / "
                     f"mesh.pipeline={pipeline}{f' / parallel.virtual_stages={virtual}' if virtual > 1 else ''}): an "
                     f"MoE group of {moe_every} layers would be split across stages (valid model.moe.every: "
                     f"{divisors(depth)}, or a multiple of {chunks * moe_every} layers)")


def microbatches_divide_rows(microbatches: int, rows: int, global_batch_size: int,
                             grad_accum: int) -> Violation | None:
    """Pipeline microbatches are equal: they divide the `rows` of the batch each device holds per step."""
    if microbatches >= 1 and rows % microbatches == 0:
        return None
    return Violation("pipeline microbatches do not divide the rows per device",
                     f"m={microbatches}, {rows} rows per device",
                     f"parallel.pipeline_microbatches={microbatches} does not divide the {rows} rows each device gets "
                     f"per step (train.global_batch_size={global_batch_size} / train.grad_accum={grad_accum} / batch "
                     f"axes): microbatches must be equal (valid: a divisor of {rows}: {divisors(rows)})")

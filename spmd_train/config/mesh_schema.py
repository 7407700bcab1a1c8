"""The `mesh` and `parallel` sections: the device mesh, the logical-axis rules, and how the state is split."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import AfterValidator

from spmd_train.config.field_types import STRICT, PositiveInt
from spmd_train.config.schedule_facts import schedule_names

MESH_AXES = ("data", "pipeline", "fsdp", "sequence", "expert", "tensor")
"""Public mesh axis names, outermost first: the fastest links go to the last axes."""

MeshAxis = Literal[MESH_AXES]
RematPolicy = Literal["none", "full", "save_matmuls", "save_matmuls_no_batch", "offload_layer_inputs", "names"]
RECOMPUTES_LAYER = frozenset({"full", "offload_layer_inputs", "names"})
"""parallel.remat policies that rerun the layer's forward pass in its backward pass, keeping only its input (names:
only the intermediates it names; the step-time and traffic models count the whole forward rerun)."""
OFFLOADS_ACTIVATIONS = frozenset({"offload_layer_inputs"})
"""parallel.remat policies that keep what they save in pinned host memory, not on the device."""
REMAT_NAMES = ("layer_input", "query", "key", "value", "attention_out", "mlp_gate", "mlp_up", "mlp_hidden")
"""The intermediates a layer names (`jax.ad_checkpoint.checkpoint_name`) for parallel.remat=names: the residual
stream entering it; attention's queries, keys and values (before RoPE) and its heads' output (before the output
projection); a dense MLP's gate and up projections and their gated product (before the down projection)."""
RematName = Literal[REMAT_NAMES]


def offloads_activations(remat: str, remat_offload: tuple[str, ...] = ()) -> bool:
    """Whether a parallel.remat policy (with its remat_offload names) keeps activations in pinned host memory."""
    return remat in OFFLOADS_ACTIVATIONS or (remat == "names" and bool(remat_offload))
ContextScheme = Literal["allgather", "ring", "ulysses"]
"""parallel.context_parallel's values: how attention joins the `sequence` chunks."""
ScheduleName = Literal[schedule_names()]
"""parallel.pipeline_schedule's values: the schedules `config.schedule_facts` registers."""

LOGICAL_AXES = ("batch", "length", "norm_length", "embed", "heads", "kv_heads", "head_dim", "q_lora", "kv_lora",
                "q_lora_in", "kv_lora_in", "mlp", "vocab", "experts", "expert_mlp", "router_experts", "layers",
                "sublayers", "first_layers")
"""Every logical axis name the model code speaks; `mesh.rules` maps these (and only these) to mesh axes."""
STACKING_AXES = ("layers", "sublayers", "first_layers")
"""Logical axes that stack copies of a layer's parameters (`models.layers.param(stack=...)`): not a matrix's axes.
`first_layers` stacks the model.moe.first_k_dense layers, which no rule splits (a pipeline runs them on every
stage, before its own stack on `layers`)."""
ZERO_AXES = ("fsdp", "sequence")
"""Mesh axes the ZeRO stage shards parameters, gradients and optimizer state over (where the rules put them: by
default a weight's `embed` dimension goes to both; `sequence`'s devices hold other tokens of the same rows)."""


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


AxisSize = Annotated[int, AfterValidator(_check_axis_size)]


@dataclass(frozen=True)
class AxisFactors:
    """Slow-link (DCN / inter-node) factor of each mesh axis; 1 means all on fast links."""

    __pydantic_config__ = STRICT

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
    The effective tables, with the rules the code adds, come from `config.resolved_rules.resolve_rules`.
    """

    __pydantic_config__ = STRICT

    preset: str = "default"
    activations: RulesTable = field(default_factory=dict)
    params: RulesTable = field(default_factory=dict)


@dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes (one may be -1: fill with the remaining devices) and layout."""

    __pydantic_config__ = STRICT

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

    __pydantic_config__ = STRICT

    zero_stage: Literal[0, 1, 2, 3] = 3
    sequence_parallel: bool = False
    context_parallel: ContextScheme = "allgather"
    """How attention sees the other devices' tokens when mesh.sequence > 1 (docs/context.md)."""
    remat: RematPolicy = "none"
    """What each layer keeps for its backward pass: none, everything autodiff saves; full, only its input (the layer
    is recomputed); save_matmuls / save_matmuls_no_batch, the matmul outputs (those without batch dimensions);
    offload_layer_inputs, full's recompute with the inputs in pinned host memory; names, the intermediates
    remat_save names on the device and those remat_offload names in host memory, the rest recomputed
    (docs/memory.md)."""
    remat_save: tuple[RematName, ...] = ()
    """parallel.remat=names: the named intermediates (`REMAT_NAMES`) each layer keeps on the device."""
    remat_offload: tuple[RematName, ...] = ()
    """parallel.remat=names: the named intermediates each layer keeps in pinned host memory."""
    pipeline_schedule: ScheduleName = "1f1b"
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

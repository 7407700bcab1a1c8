"""The `precision` section: the numeric policy, with `precision.params` and `precision.compute` the same settings as
`model.param_dtype` and `model.compute_dtype`, and recipes in `precisions/` (`precision.preset`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from spmd_train.config.field_types import STRICT, DType, PositiveFloat, PositiveInt
from spmd_train.config.optimizer_facts import is_matrix
from spmd_train.errors import ConfigError

ALIASES = {"params": "param_dtype", "compute": "compute_dtype"}
"""precision.<key> -> model.<key>: one setting under two names (the model section's came first)."""


@dataclass(frozen=True)
class PrecisionConfig:
    """What precision each copy of the weights and the optimizer's state is kept in."""

    __pydantic_config__ = STRICT

    preset: str | None = None
    """A recipe in precisions/ (fp32, mixed-bf16, bf16-master, mixed-fp16, fp16-master) or a path to a YAML file of
    precision keys; keys given beside it, here or as model.param_dtype / model.compute_dtype, win."""
    params: DType | None = None
    """The stored parameters' dtype: model.param_dtype under the policy's name (either may be given; given both, they
    must agree). Loaded configs hold the effective value in both."""
    compute: DType | None = None
    """The matmuls' operands and the activations: model.compute_dtype under the policy's name (as `params`)."""
    moments: DType | None = None
    """The optimizer's moments (AdamW's two, Lion's and Muon's momentum, Adafactor's factors): null, the parameters'
    dtype (float32 over a master copy); bfloat16 halves AdamW's 8 bytes per float32 parameter. Computed in float32
    each step, stored rounded."""
    matmul: Literal["default", "fp8", "int8"] = "default"
    """fp8: the layers' matmuls (attention projections, dense MLPs, MLA's projections, the routed experts; not the
    embedding table and LM head or the router) take e4m3 operands scaled per tensor (or per row: fp8_scaling) and e5m2
    output gradients, and ZeRO-3 gathers the dense weights in e4m3 (one byte an element). int8: the same matmuls,
    forward and both gradients, as s8 x s8 -> s32 dots with symmetric scales per token and per channel (TPU v5e/v6e's
    double-rate matmuls; dropless experts keep the compute dtype). default: the compute dtype's matmuls."""
    fp8_scaling: Literal["tensor", "row"] = "tensor"
    """precision.matmul=fp8's scales: tensor, one per tensor (its amax: current scaling), the weights gathered in e4m3;
    row, one per token of an activation and per output channel of a weight (and along the kept axes of each backward
    matmul, torchtitan's "rowwise"), closer to exact, the weights gathered in the compute dtype."""
    reduce: Literal["float32", "bfloat16"] | None = None
    """The dtype the layers' weight gradients are summed in across devices (over data and fsdp: the replica all-reduce
    and ZeRO's reduce-scatter): null, the compute dtype's (bfloat16 compute sums in bfloat16); float32 sums exactly at
    twice bfloat16's bytes, as Megatron's fp32 gradient reduction. Every `dense` weight (attention, MLPs, MLA, shared
    experts, the LM head); the embedding lookup and routed experts keep the compute dtype's. Not with
    precision.matmul=fp8|int8 (FP8 sums in the compute dtype, int8 in int32)."""
    master: Literal["none", "float32"] = "none"
    """float32: keep a float32 master copy of bfloat16 parameters (model.param_dtype=bfloat16) in the optimizer state;
    the optimizer updates the master copy (its moments in float32 too) and the parameters are its bfloat16 rounding,
    so small updates accumulate instead of rounding away: 2 + 2 + 12 bytes per parameter as in the ZeRO paper
    (Rajbhandari et al. 2020, §3.1). none: the optimizer updates the stored parameters and keeps its moments in their
    dtype."""
    loss_scale: Literal["none", "dynamic"] = "none"
    """dynamic: multiply the objective by a scale before the backward pass and divide the gradients by it, halving the
    scale when they overflow (the step is skipped) and doubling it after loss_scale_growth_interval good steps: what
    model.compute_dtype=float16 needs (float16's gradients underflow otherwise). none: no scaling."""
    loss_scale_init: PositiveFloat = 65536.0
    """The dynamic loss scale a run starts with (PyTorch's GradScaler default, 2^16)."""
    loss_scale_growth_interval: PositiveInt = 2000
    """Applied steps in a row after which the dynamic loss scale doubles (GradScaler's default)."""


def resolve_aliases(merged: dict[str, Any], raw: Mapping[str, Any]) -> None:
    """Make precision.params / compute and model.param_dtype / compute_dtype one setting in `merged` (defaults, presets
    and `raw` merged): the key `raw` gives wins over a preset's; given both ways in `raw`, they must agree."""
    precision, model = merged.get("precision"), merged.get("model")
    if not isinstance(precision, dict) or not isinstance(model, dict):
        return  # not mappings: validation names the section
    given = raw.get("precision") if isinstance(raw.get("precision"), Mapping) else {}
    given_model = raw.get("model") if isinstance(raw.get("model"), Mapping) else {}
    for alias, key in ALIASES.items():
        ours, theirs = given.get(alias), given_model.get(key)
        if ours is not None and theirs is not None and ours != theirs:
            raise ConfigError(f"precision.{alias}={ours} and model.{key}={theirs} are one setting under two names "
                              f"(valid: give one of them, or the same value to both)")
        value = ours if ours is not None else theirs if theirs is not None else precision.get(alias)
        if value is None:
            value = model.get(key)
        precision[alias] = model[key] = value


def prefer_overridden_aliases(raw: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    """An override of one name of a dtype drops the other name from the file `raw` (a run's saved config holds both):
    `config.yaml model.compute_dtype=float16` changes the setting instead of contradicting the file's copy."""
    for alias, key in ALIASES.items():
        ours, theirs = _get(overrides, "precision", alias), _get(overrides, "model", key)
        if (ours is None) != (theirs is None):
            section, name = ("model", key) if ours is not None else ("precision", alias)
            if isinstance(raw.get(section), dict):
                raw[section].pop(name, None)


def _get(tree: Mapping[str, Any], section: str, key: str) -> Any:
    body = tree.get(section)
    return body.get(key) if isinstance(body, Mapping) else None


def moment_dtype(moments: str | None, master: str, param_dtype: str) -> str:
    """The dtype the optimizer's moments are stored in under these settings (precision.moments null: the parameters',
    float32 over a master copy)."""
    return moments or ("float32" if master == "float32" else param_dtype)


KEPT_UNQUANTIZED = frozenset({"vocab", "experts", "router_experts"})
"""Logical axes of weights no `dense` matmul quantizes under precision.matmul=fp8 or int8: the embedding table and
the LM head, whose logits set the loss (as FP8 and int8 recipes keep them out), the router, and the routed experts,
which their own matmuls quantize (`quantizes_experts`), gathered in the compute dtype."""


def takes_quantized(axes: tuple[str | None, ...]) -> bool:
    """Whether a weight with these logical axes is a quantized matmul operand under precision.matmul=fp8 or int8
    (under fp8 also gathered in one byte an element): a matrix (`optimizer_facts.is_matrix`) with none of
    KEPT_UNQUANTIZED."""
    return is_matrix(axes) and not KEPT_UNQUANTIZED & set(axes)


def matmul_mode(matmul: str, fp8_scaling: str) -> str:
    """The `ops.matmul_mode.use_matmul` mode of precision.matmul and precision.fp8_scaling: default, fp8 (per-tensor
    scales), fp8-row or int8."""
    return "fp8-row" if matmul == "fp8" and fp8_scaling == "row" else matmul


def quantizes_experts(mode: str, moe_impl: str) -> bool:
    """Whether the routed experts' matmuls run quantized under this `matmul_mode` and backends.moe: FP8 at per-tensor
    scales everywhere; FP8 at row scales and int8 in the batched (capacity) matmuls, not in dropless's ragged ones
    (`ops.experts`)."""
    return mode == "fp8" or (mode in ("fp8-row", "int8") and moe_impl != "dropless")


def sums_in_reduce_dtype(axes: tuple[str | None, ...]) -> bool:
    """Whether a weight's gradient is summed across devices in precision.reduce's dtype: a matrix a `dense` matmul
    uses (not a routed expert's or the router's; an untied input table's lookup is not a matmul either)."""
    return is_matrix(axes) and not {"experts", "router_experts"} & set(axes)

"""What the config checks and the planner know of each attention implementation before jax starts.

An implementation is two registrations under one name. Its facts, here: where it runs, whether it returns the
log-sum-exp that context-parallel schemes merge blocks by, whether it keeps the [length, length] scores for the
backward, and the limits a config must meet. `backends.attention`'s values are these names plus `auto`. Its
kernel, the code: `parallel.attention_backends` (one module per implementation, registered by the same name).
tests/test_registries.py checks that the two registries name the same implementations
(docs/howto/add-an-attention-backend.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spmd_train.errors import ConfigError
from spmd_train.registry import Registry

PLATFORMS = ("cpu", "gpu", "tpu")


@dataclass(frozen=True)
class AttentionFacts:
    """An attention implementation's facts (no code)."""

    name: str
    """backends.attention's value, and the name its kernel is registered under."""
    label: str
    """How refusals name it (e.g. "cuDNN through jax")."""
    platforms: tuple[str, ...] = PLATFORMS
    """Where it runs (Pallas on "cpu": interpreted, for tests)."""
    needs: str = ""
    """What it needs, for the refusal on another platform (e.g. "NVIDIA GPUs (cuDNN's fused attention)")."""
    returns_lse: bool = True
    """It can return the log-sum-exp, so parallel.context_parallel=allgather and ring can merge its blocks."""
    keeps_scores: bool = False
    """It keeps the [length, length] scores for the backward (the planner's activation memory), as XLA's does."""
    fallback: bool = False
    """The implementation that runs on every platform and that `auto` falls back to (exactly one)."""
    variants: tuple[str, ...] = ()
    """The attention variants (`VARIANTS`) it computes exactly; a model using another one needs another
    implementation (`auto` picks one that computes them all)."""
    check: Callable[[Any, Any, str], None] | None = None
    """check(model, backends, platform): ConfigError when this run's ModelConfig or BackendsConfig does not suit it
    on `platform`, before anything is traced."""


VARIANTS = {"window": "sliding layers (model.sliding_window)",
            "softcap": "soft-capped logits (model.attn_logit_softcap)",
            "sinks": "attention sinks (model.attention_sinks)",
            "mla": "value heads of another width than query and key heads (model.mla)"}
"""The attention variants beyond full causal attention an implementation may or may not compute, and the keys that
ask for them."""


def model_variants(model: Any) -> tuple[str, ...]:
    """The variants a `ModelConfig` uses, in `VARIANTS` order."""
    used = {"window": "sliding" in model.attention_kinds, "softcap": model.attn_logit_softcap is not None,
            "sinks": model.attention_sinks, "mla": model.resolved_v_head_dim != model.resolved_head_dim}
    return tuple(v for v in VARIANTS if used[v])


def computes(name: str, model: Any) -> bool:
    """Whether implementation `name` computes every attention variant `model` uses."""
    return set(model_variants(model)) <= set(attention_facts(name).variants)


def check_variants(name: str, model: Any) -> None:
    """ConfigError naming the model's keys when implementation `name` does not compute a variant the model uses."""
    missing = [v for v in model_variants(model) if v not in attention_facts(name).variants]
    if missing:
        able = [f.name for f in _FACTS if set(model_variants(model)) <= set(f.variants)]
        raise ConfigError(f"backends.attention={name} does not compute {' or '.join(VARIANTS[v] for v in missing)} "
                          f"(valid: backends.attention={' or '.join(['auto', *able])})")


_FACTS: Registry[AttentionFacts] = Registry("attention implementation", reserved=("auto",))
register_attention_facts = _FACTS.add
"""Add an implementation's facts (ValueError for a name already taken, or `auto`)."""


def attention_facts(name: str) -> AttentionFacts:
    """The facts of implementation `name` (KeyError for `auto` or an unknown name)."""
    return _FACTS[name]


def attention_names() -> tuple[str, ...]:
    """Every registered implementation, in registration order (the order the schema and messages list them in)."""
    return _FACTS.names()


def fallback_attention() -> str:
    """The implementation that runs everywhere (XLA's), which `auto` picks where nothing faster applies."""
    return next(f.name for f in _FACTS if f.fallback)


def valid_on(platform: str) -> tuple[str, ...]:
    """backends.attention values that run on `platform`: auto, the fallback, then the rest in registration order."""
    runs = [f for f in _FACTS if platform in f.platforms]
    return ("auto", *(f.name for f in sorted(runs, key=lambda f: not f.fallback)))


def kernel_head_width(model: Any) -> int:
    """The head width attention kernels see: the query/key width, or with MLA the wider of it and the values' (values
    are zero-padded to the query/key width, `parallel.attention_dispatch`; DeepSeek-V3: 192)."""
    return max(model.resolved_head_dim, model.resolved_v_head_dim)


def _pallas_on_gpu(model: Any, backends: Any, platform: str) -> None:
    """backends.attention=pallas on a GPU: the Mosaic GPU kernels' limits (every variant is computed)."""
    if platform != "gpu":
        return
    if model.compute_dtype != "bfloat16":
        raise ConfigError(f"backends.attention=pallas on GPU needs model.compute_dtype (precision.compute)=bfloat16 "
                          f"(the kernels feed wgmma bfloat16 operands); got {model.compute_dtype}: set it, or use "
                          "backends.attention=cudnn or xla")
    width = kernel_head_width(model)
    if width % 64:
        mla = " (with model.mla: qk_nope_head_dim + qk_rope_head_dim, values zero-padded to it)" if model.mla else ""
        raise ConfigError(f"backends.attention=pallas on GPU needs a head_dim that is a multiple of 64; got "
                          f"{width}{mla}: use backends.attention=cudnn or xla")
    if backends.attention_blocks is not None and any(b % 64 or b > 256 for b in backends.attention_blocks):
        raise ConfigError(f"backends.attention_blocks={list(backends.attention_blocks)} does not suit the GPU "
                          "kernels: each must be 64, 128, 192 or 256 (64-row warpgroups, at most 4 per program)")


register_attention_facts(AttentionFacts("pallas", label="our Pallas kernels", check=_pallas_on_gpu,
                                        variants=("window", "softcap", "sinks", "mla")))
register_attention_facts(AttentionFacts("cudnn", label="cuDNN through jax", platforms=("gpu",),
                                        needs="NVIDIA GPUs (cuDNN's fused attention)", returns_lse=False,
                                        variants=("window",)))
register_attention_facts(AttentionFacts("xla", label="XLA's attention", keeps_scores=True, fallback=True,
                                        variants=tuple(VARIANTS)))

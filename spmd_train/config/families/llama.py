"""Llama (2, 3, 3.1, 3.2): the plain architecture; Llama 3.1's rope scaling and 3.2's tied embeddings are ours."""

from __future__ import annotations

from typing import Any

from spmd_train.config.families.hf_family import Family, register_family
from spmd_train.config.model_schema import ModelConfig


def _claims(model: ModelConfig) -> bool:
    return model.moe is None and not model.qkv_bias and not model.qk_norm and model.sliding_window is None


def _write(model: ModelConfig, out: dict[str, Any]) -> None:
    out["attention_bias"] = False  # its config has the field


LLAMA = register_family(Family("llama", "LlamaForCausalLM", "Llama", _claims, write=_write))

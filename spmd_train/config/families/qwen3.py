"""Qwen3: an RMSNorm on each head's query and key before RoPE (model.qk_norm); head_dim apart from d_model / heads."""

from __future__ import annotations

from typing import Any

from spmd_train.config.families.hf_family import Family, qwen_window, register_family, write_qwen_window
from spmd_train.config.families.qwen2 import both_biases_and_norms
from spmd_train.config.model_schema import ModelConfig


def _claims(model: ModelConfig) -> bool:
    return model.moe is None and model.qk_norm


def _write(model: ModelConfig, out: dict[str, Any]) -> None:
    write_qwen_window(model, out)
    out["attention_bias"] = False  # its config has the field


QWEN3 = register_family(Family("qwen3", "Qwen3ForCausalLM", "Qwen3", _claims, qk_norm=True, window=qwen_window,
                               layer_types=True, write=_write, refusal=both_biases_and_norms))

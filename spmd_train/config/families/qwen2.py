"""Qwen2 and 2.5: biases on the query, key and value projections (model.qkv_bias)."""

from __future__ import annotations

from spmd_train.config.families.hf_family import Family, qwen_window, register_family, write_qwen_window
from spmd_train.config.model_schema import ModelConfig


def _claims(model: ModelConfig) -> bool:
    return model.moe is None and model.qkv_bias


def both_biases_and_norms(model: ModelConfig) -> str | None:
    """No family here has Q/K/V biases and Q/K norms together."""
    if model.qkv_bias and model.qk_norm:
        return "no supported family has both Q/K/V biases (Qwen2) and Q/K norms (Qwen3)"
    return None


QWEN2 = register_family(Family("qwen2", "Qwen2ForCausalLM", "Qwen2", _claims, qkv_bias=True, window=qwen_window,
                               layer_types=True, write=write_qwen_window, refusal=both_biases_and_norms))

"""Mistral: Llama with a recorded attention window (sliding_window -> model.sliding_window)."""

from __future__ import annotations

from spmd_train.config.families.hf_family import Family, register_family, write_plain_window
from spmd_train.config.model_schema import ModelConfig


def _claims(model: ModelConfig) -> bool:
    return model.moe is None and not model.qkv_bias and not model.qk_norm and model.sliding_window is not None


MISTRAL = register_family(Family("mistral", "MistralForCausalLM", "Mistral", _claims, write=write_plain_window))

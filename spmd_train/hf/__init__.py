"""Hugging Face interop: import published Llama/Mistral/Qwen2/Qwen3/Mixtral/Qwen3-MoE checkpoints, export ours."""

from spmd_train.hf.export import export_hf
from spmd_train.hf.import_params import load_hf_params

__all__ = ["export_hf", "load_hf_params"]

"""The Hugging Face model families, one module each; importing this package registers every one of them.

A module defines its `Family` (config.json fields and tensor names, both ways) and registers it
(docs/howto/add-a-model-family.md).
"""

# Registered in this order, the order messages list them in and export tries them (Llama before Mistral).
from spmd_train.config.families import (  # noqa: F401, I001 (importing a module registers its family)
    llama,
    mistral,
    qwen2,
    qwen3,
    mixtral,
    qwen3_moe,
    gemma3,
    deepseek_v3,
    deepseek_v2,
    gpt_oss,
)
from spmd_train.config.families.hf_family import (
    Family,
    TensorNames,
    families,
    family_named,
    refuse_field,
)

__all__ = ["Family", "TensorNames", "families", "family_named", "refuse_field"]

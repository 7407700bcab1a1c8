"""The attention implementations' kernels, one module each; importing this package registers every one of them.

A module defines its kernel and registers `AttentionBackend(name, kernel)`; its facts are registered under the
same name in `config.attention_facts` (docs/howto/add-an-attention-backend.md).
"""

# Registered in `config.attention_facts`' order, the order error messages list them in.
from spmd_train.parallel.attention_backends import (  # noqa: F401, I001 (importing a module registers its kernel)
    pallas_backend,
    cudnn_backend,
    xla_backend,
)
from spmd_train.parallel.attention_registry import AttentionBackend, attention_backend, registered_attention

__all__ = ["AttentionBackend", "attention_backend", "registered_attention"]

"""Flash attention as Pallas kernels (forward and backward) for TPU (Mosaic) and Hopper GPUs (Mosaic GPU).

Their reference semantics are `spmd_train.ops.dot_product_attention`.
"""

from spmd_train.kernels.flash_attention.api import TPU_VMEM_BUDGET, BlockSizes, flash_attention, tpu_vmem_bytes

__all__ = ["TPU_VMEM_BUDGET", "BlockSizes", "flash_attention", "tpu_vmem_bytes"]

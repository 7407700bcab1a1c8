"""Flash attention as Pallas kernels (forward and backward), with the plain-XLA reference beside them."""

from spmd_train.kernels.flash_attention.api import TPU_VMEM_BUDGET, BlockSizes, flash_attention, tpu_vmem_bytes
from spmd_train.kernels.flash_attention.reference import reference_attention

__all__ = ["TPU_VMEM_BUDGET", "BlockSizes", "flash_attention", "reference_attention", "tpu_vmem_bytes"]

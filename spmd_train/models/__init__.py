"""Model code: NNX modules that speak logical axis names only."""

from spmd_train.models.transformer import Transformer

__all__ = ["Transformer"]

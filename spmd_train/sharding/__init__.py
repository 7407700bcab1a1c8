"""Logical sharding: rules tables -> PartitionSpecs, and the `constrain` helper for model code."""

from spmd_train.sharding.constrain import active_layout, constrain, use_layout
from spmd_train.sharding.layout import Layout, LogicalSpec

__all__ = ["Layout", "LogicalSpec", "active_layout", "constrain", "use_layout"]

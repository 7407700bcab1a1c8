"""The analytic model `plan` and `describe` share: memory, collective bytes and step time of a layout, by formula."""

from spmd_train.analysis.plan.candidate import Candidate, Workload
from spmd_train.analysis.plan.model import Estimate, estimate
from spmd_train.analysis.plan.shape import ModelShape

__all__ = ["Candidate", "Estimate", "ModelShape", "Workload", "estimate"]

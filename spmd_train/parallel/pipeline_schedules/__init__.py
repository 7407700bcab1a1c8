"""The pipeline schedules' op orders, one module each; importing this package registers every one of them.

A module defines its order function and registers `ScheduleOrder(name, orders)`; its facts are registered under
the same name in `config.schedule_facts` (docs/howto/add-a-pipeline-schedule.md).
"""

from spmd_train.parallel.pipeline_schedules import (  # noqa: F401 (importing a module registers its schedule)
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zb_h1,
    zb_v,
)
from spmd_train.parallel.schedule_registry import ScheduleOrder, registered_orders, schedule_order

__all__ = ["ScheduleOrder", "registered_orders", "schedule_order"]

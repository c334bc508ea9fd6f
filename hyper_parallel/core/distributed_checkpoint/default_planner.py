"""torch DCP's default planners (torch path ``torch.distributed.checkpoint.default_planner``).

A face over :mod:`.planning.torch_planners`: ``DefaultSavePlanner``/``DefaultLoadPlanner`` with
torch's signatures; torch's plan-building functions are there only to say what to use instead.
"""

from .planning.torch_planners import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_global_load_plan,
    create_default_global_save_plan,
    create_default_local_load_plan,
    create_default_local_save_plan,
)

__all__ = [
    "DefaultSavePlanner",
    "DefaultLoadPlanner",
    "create_default_local_load_plan",
    "create_default_global_load_plan",
    "create_default_local_save_plan",
    "create_default_global_save_plan",
]

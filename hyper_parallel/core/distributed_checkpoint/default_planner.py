"""torch DCP's default planners (torch path ``torch.distributed.checkpoint.default_planner``).

A face. ``DefaultSavePlanner``/``DefaultLoadPlanner`` and the plan-building functions are torch's
own: code that calls their protocol methods itself (``set_up_planner``, ``create_local_plan``,
``create_default_local_save_plan(...)``) gets torch's behaviour exactly. Given to this library's
``save``/``load``, an unmodified one is taken as configuration and runs our planner with its
options (:mod:`._src.planning.torch_planners`); a subclass that overrides a hook runs on torch's
protocol with its hooks called (``engine/protocol_run.py``). The private helpers torch's tests
import from here (``_create_default_local_metadata``, ``_validate_global_plan``,
``_EmptyStateDictLoadPlanner``) are torch's too.
"""

from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_global_load_plan,
    create_default_global_save_plan,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.default_planner import (
    _create_default_local_metadata as _create_default_local_metadata,  # torch's private helper
)
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner as _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.default_planner import _validate_global_plan as _validate_global_plan

__all__ = [
    "DefaultSavePlanner",
    "DefaultLoadPlanner",
    "create_default_local_load_plan",
    "create_default_global_load_plan",
    "create_default_local_save_plan",
    "create_default_global_save_plan",
]

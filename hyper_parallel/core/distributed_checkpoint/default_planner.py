"""torch DCP's default planners (torch path ``torch.distributed.checkpoint.default_planner``).

A face over :mod:`.planning.torch_planners`: ``DefaultSavePlanner``/``DefaultLoadPlanner`` with
torch's signatures; torch's plan-building functions are there only to say what to use instead.
``_create_default_local_metadata`` (private, imported by torch's tests) is torch's own: it
describes a state dict as torch's ``Metadata``.
"""

from torch.distributed.checkpoint.default_planner import (
    _create_default_local_metadata as _create_default_local_metadata,  # torch's private helper
)

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

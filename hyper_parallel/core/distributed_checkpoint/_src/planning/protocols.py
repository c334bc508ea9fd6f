"""torch DCP's planner ABCs at the ``planner`` import path, open to HyperParallel's method names too.

:class:`SavePlanner` and :class:`LoadPlanner` are subclasses of torch's ABCs (torch's class
attributes, e.g. the plan caches ``_cached_save_plan``, are theirs). A subclass written for torch
implements torch's hooks (``set_up_planner``, ``create_local_plan``, ``create_global_plan``,
``finish_plan``, ``resolve_data`` / ``resolve_tensor``, ``commit_tensor``, ``load_bytes``) and is
held to torch's abstract methods; one written for HyperParallel implements its names
(``configure_planner``, ``build_local_plan``, ``build_global_plan``, ``finalize_plan``, ...) and is
run by them (:mod:`.hyper_parallel_protocol`). Either runs under this library's ``save``/``load``.

This library's own planners plan in boxes on another protocol (:mod:`.planner`,
``StandardPlanner``); they are not subclasses of these.
"""

from __future__ import annotations

from torch.distributed.checkpoint import planner as _torch_planner

from ..base.either_protocol import EitherProtocol

__all__ = ["SavePlanner", "LoadPlanner", "SEED_PLANNER_NAMES"]

SEED_PLANNER_NAMES = ("configure_planner", "build_local_plan", "build_global_plan", "finalize_plan")


class SavePlanner(_torch_planner.SavePlanner, metaclass=EitherProtocol):
    """torch DCP's ``SavePlanner`` (see the module docstring for HyperParallel's form)."""

    _HYPER_PARALLEL_NAMES = SEED_PLANNER_NAMES


class LoadPlanner(_torch_planner.LoadPlanner, metaclass=EitherProtocol):
    """torch DCP's ``LoadPlanner`` (see the module docstring for HyperParallel's form)."""

    _HYPER_PARALLEL_NAMES = SEED_PLANNER_NAMES

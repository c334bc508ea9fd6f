"""``hyper_parallel.core.fully_shard.api.fully_shard``: torch's FSDP2 ``fully_shard`` itself.

``fully_shard(module, mesh=, reshard_after_forward=, mp_policy=)`` is torch's. The module
it returns is torch's ``FSDPModule``. One HyperParallel module method is added to torch's
``FSDPModule`` class (torch has no method of that name):

``module.set_reduce_op_type("sum" | "avg")`` chooses how gradients are reduced across the
data-parallel ranks. HyperParallel passes a reduce op (``ReduceOp.SUM``/``ReduceOp.AVG``) to
its reduce-scatter; torch FSDP2 always sums and then divides by a *gradient divide factor*
(the data-parallel size by default, i.e. an average). So ``"avg"`` restores torch's default
factor and ``"sum"`` sets the factor to 1 with a plain SUM reduction
(``set_gradient_divide_factor(1.0)`` plus ``set_force_sum_reduction_for_comms(True)``, which
also works on gloo): the same gradients HyperParallel's ops give. The choice applies to every ``fully_shard``-ed
module inside ``module`` (itself included), as the seed's "all gradient reductions" says; the
chosen name is kept on each as ``module.reduce_op_type``. Other HyperParallel module methods
(``set_gradient_scaling_factor``, ...) do not exist here.
"""

from __future__ import annotations

from typing import cast

import torch
from torch.distributed.fsdp import FSDPModule, fully_shard

__all__ = ["fully_shard", "FSDPModule", "set_reduce_op_type", "REDUCE_OP_TYPES"]

REDUCE_OP_TYPES = ("sum", "avg")
"""The reduce op names ``set_reduce_op_type`` accepts (the seed's)."""


def set_reduce_op_type(module: FSDPModule, reduce_op_type: str) -> None:
    """Reduce the gradients of ``module``'s FSDP units by ``"sum"`` or ``"avg"`` (the default).

    Args:
        module: a module ``fully_shard`` was applied to (its FSDP submodules follow too).
        reduce_op_type: ``"sum"`` or ``"avg"`` (case and surrounding spaces ignored).

    Raises:
        ValueError: another name; ``module`` was not ``fully_shard``-ed.

    Example::

        fully_shard(model, mesh=mesh)
        model.set_reduce_op_type("sum")   # gradients summed over the dp ranks, not averaged
    """
    op = reduce_op_type.strip().lower() if isinstance(reduce_op_type, str) else reduce_op_type
    if op not in REDUCE_OP_TYPES:
        raise ValueError(f"Unsupported reduce op type {reduce_op_type!r}, supported types are {list(REDUCE_OP_TYPES)}")
    if not isinstance(module, FSDPModule):
        raise ValueError(f"set_reduce_op_type needs a module fully_shard was applied to, got {type(module).__name__}")
    for sub in cast(torch.nn.Module, module).modules():
        if not isinstance(sub, FSDPModule):
            continue
        state = sub._get_fsdp_state()
        for group in state._fsdp_param_groups:
            # None is torch's default: divide by the data-parallel size (an average). A factor
            # alone makes torch use PREMUL_SUM, which gloo lacks; forcing a plain SUM with a
            # divide factor of 1 is the same sum on every backend.
            group.gradient_divide_factor = 1.0 if op == "sum" else None
            group.force_sum_reduction_for_comms = op == "sum"
        sub.reduce_op_type = op  # type: ignore[attr-defined]


if not hasattr(FSDPModule, "set_reduce_op_type"):
    FSDPModule.set_reduce_op_type = set_reduce_op_type  # type: ignore[attr-defined]

"""set_reduce_op_type on a fully_shard-ed model: "sum" sums the dp ranks' gradients, "avg" averages."""

from __future__ import annotations

import pytest
import torch
from multiprocess import run_ranks

from hyper_parallel import fully_shard, init_device_mesh
from hyper_parallel.core.fully_shard.api import FSDPModule, set_reduce_op_type


def _grads(rank: int, world: int, op: str | None) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    if op is not None:
        model.set_reduce_op_type(op)
    x = torch.full((3, 4), float(rank + 1))       # different data per rank
    model(x).sum().backward()
    return {"grads": [p.grad.full_tensor().tolist() for p in model.parameters()],
            "ops": [getattr(m, "reduce_op_type", None) for m in model.modules() if isinstance(m, FSDPModule)]}


def test_sum_gives_twice_the_default_average_on_two_ranks():
    default = run_ranks(_grads, 2, None)[0]
    avg = run_ranks(_grads, 2, "avg")[0]
    summed = run_ranks(_grads, 2, " SUM ")[0]
    for d, a, s in zip(default["grads"], avg["grads"], summed["grads"], strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(d))
        torch.testing.assert_close(torch.tensor(s), 2 * torch.tensor(d))
    assert avg["ops"] == ["avg", "avg"] and summed["ops"] == ["sum", "sum"]


def test_unknown_op_is_refused():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="supported types are"):
        set_reduce_op_type(model, "max")  # checked before the module is


def test_needs_a_fully_shard_module():
    with pytest.raises(ValueError, match="fully_shard"):
        set_reduce_op_type(torch.nn.Linear(2, 2), "sum")


def test_installed_on_torchs_fsdp_module():
    assert FSDPModule.set_reduce_op_type is set_reduce_op_type

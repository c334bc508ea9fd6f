"""SkipDTensorDispatch: DTensor operators run on the local shards inside the block."""

from __future__ import annotations

import torch
from multiprocess import run_ranks
from torch.distributed.tensor import Shard, distribute_tensor

import hyper_parallel
from hyper_parallel import SkipDTensorDispatch, init_device_mesh
from hyper_parallel.core.dtensor.dtensor import DTensor


def test_exported_at_the_seed_paths():
    from hyper_parallel.core.dtensor import SkipDTensorDispatch as inner

    assert hyper_parallel.SkipDTensorDispatch is inner is SkipDTensorDispatch


def test_plain_tensors_are_untouched():
    with SkipDTensorDispatch():
        assert torch.equal(torch.ones(2) + 1, torch.full((2,), 2.0))


def _local_ops(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    p = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    g = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    with SkipDTensorDispatch():
        p.add_(g, alpha=-0.5)                 # in place, on this rank's shard
        doubled = p * 2                       # a plain local tensor
        total = p.sum()                       # the local sum: no all-reduce
        kept = torch.zeros_like(p)
    with SkipDTensorDispatch(no_skip={torch.ops.aten.zeros_like.default}):
        still = torch.zeros_like(p)
    return {"p": p.full_tensor().tolist(), "doubled_type": type(doubled).__name__,
            "doubled": doubled.tolist(), "total": total.item(), "kept_type": type(kept).__name__,
            "still_type": type(still).__name__, "still_shape": tuple(still.shape),
            "after": type(p * 2).__name__}


def test_operators_run_on_local_shards_on_real_ranks():
    out = run_ranks(_local_ops, 2)
    expected = (torch.arange(8.0).reshape(4, 2) - 0.5).tolist()
    for rank, r in enumerate(out):
        assert r["p"] == expected
        local = torch.tensor(expected[2 * rank:2 * rank + 2])
        assert r["doubled_type"] == "Tensor" and r["doubled"] == (local * 2).tolist()
        assert r["total"] == local.sum().item()
        assert r["kept_type"] == "Tensor"
        assert r["still_type"] == "DTensor" and r["still_shape"] == (4, 2)
        assert r["after"] == "DTensor"  # the mode ends with the block


def _fsdp_step_in_block(rank: int, world: int) -> list:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    ref.load_state_dict(model.state_dict())
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.ones(2, 4)
    with SkipDTensorDispatch():                   # HyperParallel's training step, as its tests write it
        loss = model(x).sum()
        loss.backward()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.1)
            p.grad = None
    ref(x).sum().backward()
    with torch.no_grad():
        for q in ref.parameters():
            q.add_(q.grad, alpha=-0.1)
    return [(p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters(), strict=True)]


def test_fsdp2_training_step_inside_the_block_matches_a_single_process_step():
    for diffs in run_ranks(_fsdp_step_in_block, 2):
        assert max(diffs) < 1e-6


def test_dtensor_class_is_torchs():
    assert DTensor is torch.distributed.tensor.DTensor

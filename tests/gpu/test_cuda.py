"""GPU paths (issue 11.7): save, load, reshard and async save with CUDA tensors.

Skipped without CUDA; ``bash scripts/gpu_check.sh`` runs them (and the local tier's device
check) on a machine with a GPU. What they pin down:

- a save's writer threads copy device tensors to the host only after the caller's stream
  has finished producing them (no explicit synchronize by the caller);
- a CUDA target is filled in place on its device (never through ``.numpy()``), bit-exact;
- async saves snapshot device tensors (pinned staging) so later in-place updates do not
  leak into the checkpoint, and report loudly when pinning is not possible;
- DTensors on a CUDA mesh save and load on 2 gloo ranks sharing the device, and reshard
  offline into a layout that CUDA targets then load.
"""

from __future__ import annotations

import pytest
import torch
from multiprocess import run_ranks

from hyper_parallel.core.distributed_checkpoint import (
    async_save,
    load,
    offline_transform,
    save,
    verify_checkpoint,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def slow_producer(n: int = 4096, rounds: int = 30) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor whose final value a long queue of kernels produces on the current stream."""
    a = torch.randn(n, n, device="cuda") / n
    out = torch.zeros(n, n, device="cuda")
    for _ in range(rounds):
        out = out + a @ a  # queued; the caller does not synchronize
    return out, a


def test_save_orders_device_copies_after_the_callers_stream(tmp_path):
    out, _ = slow_producer()
    save({"w": out}, checkpoint_id=str(tmp_path), no_dist=True)  # no synchronize before it
    loaded = load(path=str(tmp_path))["w"]
    assert torch.equal(loaded, out.cpu())


def test_a_save_from_a_side_stream_is_ordered_too(tmp_path):
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out, _ = slow_producer()
        save({"w": out}, checkpoint_id=str(tmp_path), no_dist=True)
    side.synchronize()
    assert torch.equal(load(path=str(tmp_path))["w"], out.cpu())


def test_cuda_targets_load_in_place_on_their_device(tmp_path):
    sd = {"f32": torch.randn(1000, 33, device="cuda"), "bf16": torch.randn(77, 5, device="cuda").bfloat16(),
          "i64": torch.arange(100, device="cuda"), "cpu": torch.arange(9.0), "step": 7}
    save(sd, checkpoint_id=str(tmp_path), no_dist=True)
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}
    ptrs = {k: v.data_ptr() for k, v in target.items() if isinstance(v, torch.Tensor)}
    load(target, checkpoint_id=str(tmp_path), no_dist=True)
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert target[k].device == v.device and target[k].data_ptr() == ptrs[k], k
            assert torch.equal(target[k], v), k
    assert target["step"] == 7


def test_async_save_snapshots_device_tensors(tmp_path):
    w = torch.randn(2048, 1024, device="cuda")
    expected = w.cpu().clone()
    response = async_save({"w": w}, checkpoint_id=str(tmp_path), no_dist=True)
    w.add_(1.0)  # training goes on while the save is in flight
    response.result()
    assert torch.equal(load(path=str(tmp_path))["w"], expected)
    assert verify_checkpoint(str(tmp_path)).ok


def rank_cuda_dtensor(rank: int, ws: int, path: str, phase: str) -> bool:
    from helpers import make_tensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cuda", (ws,))
    full = make_tensor((64, 48), seed=5).cuda()
    rows = 64 // ws
    if phase == "save":
        local = full[rank * rows:(rank + 1) * rows].clone()
        sd = {"w": DTensor.from_local(local, mesh, [Shard(0)], run_check=False), "step": 3}
        save(sd, checkpoint_id=path)
        return True
    cols = 48 // ws  # the resharded checkpoint splits dim 1
    target = {"w": DTensor.from_local(torch.zeros(64, cols, device="cuda"), mesh, [Shard(1)], run_check=False),
              "step": 0}
    load(target, checkpoint_id=path)
    got = target["w"].to_local()
    return got.device.type == "cuda" and torch.equal(got, full[:, rank * cols:(rank + 1) * cols]) \
        and target["step"] == 3


def test_cuda_dtensors_on_two_ranks_then_reshard_offline(tmp_path):
    from hyper_parallel.core.distributed_checkpoint import Layout, TensorLayout

    src, dst = str(tmp_path / "s0"), str(tmp_path / "s1")
    assert run_ranks(rank_cuda_dtensor, 2, src, "save") == [True, True]
    mesh = Layout((2,), ("dp",))
    offline_transform(src, dst, dst_layout={"w": TensorLayout(mesh, {1: [0]}, 2)})  # dim 1 split over dp
    assert verify_checkpoint(dst).ok
    assert run_ranks(rank_cuda_dtensor, 2, dst, "load") == [True, True]


def rank_cuda_shared(rank: int, ws: int, path: str) -> bool:
    from helpers import make_tensor

    full = make_tensor((64, 48), seed=6)
    target = {"w": torch.zeros(64, 48, device="cuda"), "b": torch.zeros(48, device="cuda").to(torch.bfloat16)}
    load(target, checkpoint_id=path, broadcast_replicated_tensors=True)  # each replicated slab read once
    return (target["w"].device.type == "cuda" and torch.equal(target["w"].cpu(), full)
            and torch.equal(target["b"].cpu(), full[0].to(torch.bfloat16)))


def test_shared_reads_into_cuda_targets(tmp_path):
    """Replicated CUDA targets: the owner reads into its device target and sends a host copy;
    the other rank receives into host memory and copies to its device."""
    from helpers import make_tensor

    full = make_tensor((64, 48), seed=6)
    save({"w": full, "b": full[0].clone()}, checkpoint_id=str(tmp_path), no_dist=True)
    assert run_ranks(rank_cuda_shared, 2, str(tmp_path)) == [True, True]

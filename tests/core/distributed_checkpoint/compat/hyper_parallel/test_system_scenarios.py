"""Code written for HyperParallel's DCP runs unchanged: its system tests' scenarios, on real
gloo ranks (8 where HyperParallel uses 8): a (4,2)-mesh round trip with and without
collectives, rank-local tensors, an 8-rank save loaded on a (2,2) mesh over ranks 0-3 while
the others stay idle, metadata on every rank, dtype-converting loads, async saves with
HyperParallel's callback convention, and rank-local checkpoints missing a fragment."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from helpers import make_dtensor, make_tensor
from multiprocess import run_ranks
from torch.distributed.checkpoint.metadata import Metadata as TorchMetadata
from torch.distributed.tensor import Replicate, Shard

from hyper_parallel import init_device_mesh
from hyper_parallel.cli import main as cli
from hyper_parallel.core.distributed_checkpoint import (
    CheckpointError,
    Metadata,
    MetadataError,
    RankFailedError,
    StateDictMismatchError,
    async_save,
    load,
    save,
    verify_checkpoint,
)
from hyper_parallel.core.distributed_checkpoint.reshard import reshard

SCALARS = {"step": 7, "lr": 0.5, "name": "run-a", "flag": True, "betas": (0.9, 0.99), "none": None}


def globals_() -> dict[str, torch.Tensor]:
    return {"w": make_tensor((10, 6), seed=1), "b": make_tensor((9,), seed=2), "emb": make_tensor((7, 5), seed=3),
            "plain": make_tensor((3, 4), seed=4)}


def sharded(mesh, dtype=None) -> dict:
    g = {k: v.to(dtype) if dtype else v for k, v in globals_().items()}
    return {"w": make_dtensor(g["w"], mesh, [Shard(0), Shard(1)]),
            "b": make_dtensor(g["b"], mesh, [Replicate(), Shard(0)]),
            "emb": make_dtensor(g["emb"], mesh, [Shard(1), Replicate()]),
            "plain": g["plain"]}


def zeros(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        if hasattr(v, "to_local"):
            out[k] = make_dtensor(torch.zeros_like(v.test_full), v.device_mesh, list(v.placements))
        else:
            out[k] = torch.zeros_like(v)
    return out


def same_local(a, b) -> bool:
    la = a.to_local() if hasattr(a, "to_local") else a
    lb = b.to_local() if hasattr(b, "to_local") else b
    return la.dtype == lb.dtype and torch.equal(la, lb)


def rank_eight(rank: int, ws: int, root: str) -> dict:
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    sd = {**sharded(mesh), **SCALARS}
    out = {}
    # 1. the (4,2) round trip with collectives: Metadata on every rank, scalars keep their types
    meta = save(sd, checkpoint_id=os.path.join(root, "coll"))
    assert isinstance(meta, Metadata) and set(meta.state_dict_metadata) == set(sd)
    assert tuple(meta.state_dict_metadata["w"].size) == (10, 6)
    target = {**zeros(sharded(mesh)), **{k: None for k in SCALARS}}
    load(target, checkpoint_id=os.path.join(root, "coll"))
    assert all(same_local(target[k], sd[k]) for k in globals_())
    assert {k: target[k] for k in SCALARS} == SCALARS and type(target["betas"]) is tuple
    # 2. the same without collectives: each rank writes its own shards and fragment
    meta = save(sd, checkpoint_id=os.path.join(root, "local"), use_collectives=False)
    assert meta.fragment == (rank, ws)
    target = {**zeros(sharded(mesh)), **{k: None for k in SCALARS}}
    load(target, checkpoint_id=os.path.join(root, "local"), use_collectives=False)
    assert all(same_local(target[k], sd[k]) for k in globals_()) and target["step"] == 7
    # ... and the fragments read as one checkpoint by a collective load under another layout
    # (once every rank has written its fragment: rank-local saves do not wait for each other)
    dist.barrier()
    flat8 = init_device_mesh("cpu", (8,), mesh_dim_names=("all",))
    other = {k: make_dtensor(torch.zeros_like(v), flat8, [Shard(0)]) for k, v in globals_().items()}
    load(other, checkpoint_id=os.path.join(root, "local"))
    assert all(torch.equal(other[k].to_local(), make_dtensor(v, flat8, [Shard(0)]).to_local())
               for k, v in globals_().items())
    # 3. tensors only, without collectives
    tensors = sharded(mesh)
    save(tensors, checkpoint_id=os.path.join(root, "tensors"), use_collectives=False)
    dist.barrier()
    back = zeros(sharded(mesh))
    load(back, checkpoint_id=os.path.join(root, "tensors"), use_collectives=False)
    assert all(same_local(back[k], tensors[k]) for k in tensors)
    # 4. a dtype-converting load: bf16 targets of a float32 checkpoint
    half = zeros(sharded(mesh, torch.bfloat16))
    load(half, checkpoint_id=os.path.join(root, "coll"), strict=False)
    assert all(same_local(half[k], sharded(mesh, torch.bfloat16)[k]) for k in globals_())
    # 5. an 8-rank checkpoint loaded on a (2,2) mesh over ranks 0-3; ranks 4-7 do not call load
    if rank < 4:
        small = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), rank_list=[0, 1, 2, 3])
        t = {k: make_dtensor(torch.zeros_like(v), small, [Shard(0), Replicate()]) for k, v in globals_().items()}
        load(t, checkpoint_id=os.path.join(root, "coll"), strict=False)
        out["subset"] = all(torch.equal(t[k].to_local(), make_dtensor(v, small, [Shard(0), Replicate()]).to_local())
                            for k, v in globals_().items())
    dist.barrier()
    # 6. a rank-local checkpoint with one fragment deleted: every reader names the rank
    if rank == 0:
        os.unlink(os.path.join(root, "local", ".metadata-r00005"))
    dist.barrier()
    with pytest.raises(RankFailedError, match=r"rank\(s\) \[5\] are missing"):
        load({**zeros(sharded(mesh)), **{k: None for k in SCALARS}}, checkpoint_id=os.path.join(root, "local"))
    return out


def test_hyper_parallel_scenarios_on_eight_ranks(tmp_path):
    root = str(tmp_path)
    outs = run_ranks(rank_eight, 8, root, timeout_s=300, pg_timeout_s=120)
    assert [o.get("subset") for o in outs] == [True] * 4 + [None] * 4
    # every other reader of the fragments with rank 5's missing raises naming it too
    broken = os.path.join(root, "local")
    for attempt in (lambda: load(path=broken), lambda: reshard(broken, str(tmp_path / "r"), dst_mesh={"x": 2})):
        with pytest.raises(MetadataError, match=r"rank\(s\) \[5\] are missing"):
            attempt()
    assert "rank(s) [5] are missing" in " ".join(verify_checkpoint(broken).problems)
    assert cli(["inspect", broken]) == 2
    # the complete rank-local checkpoint reads as one in a single process
    whole = load(path=os.path.join(root, "tensors"))
    assert all(torch.equal(whole[k], v) for k, v in globals_().items())


def rank_async(rank: int, ws: int, root: str) -> dict:
    mesh = init_device_mesh("cpu", (ws,))
    sd = {"w": make_dtensor(make_tensor((8, 3)), mesh, [Shard(0)]), "step": 3}
    calls = []
    resp = async_save(sd, checkpoint_id=os.path.join(root, "a"), use_collectives=True, use_gloo=True,
                      callback=lambda: calls.append("no-arg"))  # HyperParallel's convention
    sd["w"].to_local().add_(1000)  # the snapshot is taken: changing the tensors is fine
    meta = resp.get_result()
    resp2 = async_save(sd, checkpoint_id=os.path.join(root, "b"), callback=lambda r: calls.append(type(r).__name__))
    resp2.result()
    assert resp.persist_completion.done() and isinstance(resp.persist_completion.result(), Metadata)
    target = {"w": make_dtensor(torch.zeros(8, 3), mesh, [Shard(0)]), "step": 0}
    load(target, checkpoint_id=os.path.join(root, "a"))
    want = make_dtensor(make_tensor((8, 3)), mesh, [Shard(0)]).to_local()
    shaped = isinstance(meta, Metadata) and isinstance(meta, TorchMetadata)  # HyperParallel's and torch's
    return {"meta": shaped, "calls": calls, "exact": torch.equal(target["w"].to_local(), want)}


def test_async_save_with_hyper_parallel_callbacks_and_get_result(tmp_path):
    for out in run_ranks(rank_async, 2, str(tmp_path), timeout_s=120):
        assert out == {"meta": True, "calls": ["no-arg", "AsyncSaveFuture"], "exact": True}


def test_a_rank_local_save_refuses_a_directory_with_a_collective_checkpoint(tmp_path):
    save({"w": torch.ones(2)}, str(tmp_path))
    out = run_ranks(rank_local_over_collective, 2, str(tmp_path))
    assert out == ["refused", "refused"]


def rank_local_over_collective(rank: int, ws: int, path: str) -> str:
    try:
        save({"w": torch.ones(2)}, path, use_collectives=False)
    except CheckpointError as exc:
        assert "saved with collectives" in str(exc)
        return "refused"
    return "saved"


def rank_local_twice(rank: int, ws: int, path: str, fail_ranks: tuple[int, ...]) -> str:
    import resource

    mesh = init_device_mesh("cpu", (ws,))
    save({"w": make_dtensor(torch.full((1024 * ws, 64), 1.0), mesh, [Shard(0)])}, path, use_collectives=False)
    if rank in fail_ranks:  # this rank's disk is full for the next save
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))
    try:
        save({"w": make_dtensor(torch.full((1024 * ws, 64), 2.0), mesh, [Shard(0)])}, path, use_collectives=False)
    except OSError:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        failed = True
    else:
        failed = False
    dist.barrier()  # every rank's save has ended
    if failed:
        target = {"w": make_dtensor(torch.zeros(1024 * ws, 64), mesh, [Shard(0)])}
        try:  # its own (older) fragment: loads only if every rank's save failed alike
            load(target, path, use_collectives=False)
        except MetadataError:
            return "failed, own fragment refused"
        return f"failed, own fragment loads {target['w'].to_local()[0, 0].item()}"
    return "saved"


def test_a_failed_rank_local_save_never_loads_as_a_mix_of_two_saves(tmp_path):
    # rank 1's save failed and its old fragment stayed beside rank 0's new one: the checkpoint
    # loaded as complete, half old and half new
    path = str(tmp_path / "ck")
    assert run_ranks(rank_local_twice, 2, path, (1,)) == ["saved", "failed, own fragment refused"]
    with pytest.raises(MetadataError, match=r"failed on rank\(s\) \[1\]"):
        load(path=path)
    # every rank failing keeps the old checkpoint whole
    path = str(tmp_path / "all")
    assert run_ranks(rank_local_twice, 2, path, (0, 1)) == ["failed, own fragment loads 1.0"] * 2
    assert torch.equal(load(path=path)["w"], torch.full((2048, 64), 1.0))
    # a smaller world saving over a bigger one's rank-local checkpoint leaves no stale fragments
    path = str(tmp_path / "shrink")
    assert run_ranks(rank_local_twice, 4, path, ()) == ["saved"] * 4
    assert run_ranks(rank_local_twice, 2, path, ()) == ["saved"] * 2
    assert torch.equal(load(path=path)["w"], torch.full((2048, 64), 2.0))
    assert sorted(n for n in os.listdir(path) if n.startswith(".metadata")) == [".metadata-r00000", ".metadata-r00001"]
    assert len([n for n in os.listdir(path) if n.endswith(".safetensors")]) == 2


def rank_local_per_rank_values(rank: int, ws: int, path: str) -> list:
    import warnings

    mesh = init_device_mesh("cpu", (ws,))
    save({"w": make_dtensor(torch.ones(4, 2), mesh, [Shard(0)]), "step": 100 + rank}, path, use_collectives=False)
    own = {"w": make_dtensor(torch.zeros(4, 2), mesh, [Shard(0)]), "step": 0}
    load(own, path, use_collectives=False)
    merged = {"w": make_dtensor(torch.zeros(4, 2), mesh, [Shard(0)]), "step": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load(merged, path)
    return [own["step"], merged["step"], any("different plain values" in str(w.message) for w in caught)]


def test_per_rank_plain_values_of_a_rank_local_checkpoint_read_as_one_are_warned_about(tmp_path):
    # read as one checkpoint, rank 1 silently got rank 0's step
    out = run_ranks(rank_local_per_rank_values, 2, str(tmp_path / "ck"))
    assert out == [[100, 100, True], [101, 100, False]], out  # the coordinator, who reads the fragments, warns


def rank_local_under_another_layout(rank: int, ws: int, path: str) -> str:
    mesh = init_device_mesh("cpu", (ws,))
    save({"w": make_dtensor(make_tensor((4, 6)), mesh, [Shard(0)])}, path, use_collectives=False)
    target = {"w": make_dtensor(torch.zeros(4, 6), mesh, [Shard(1)])}
    try:
        load(target, path, use_collectives=False)
    except StateDictMismatchError as exc:
        msg = str(exc)
    load(target, path)  # every fragment: any layout
    assert torch.equal(target["w"].full_tensor(), make_tensor((4, 6)))
    return msg


def test_a_rank_local_load_under_another_layout_says_to_read_every_fragment(tmp_path):
    # it said "a rank's chunk is missing from the checkpoint" of a checkpoint that was whole
    for msg in run_ranks(rank_local_under_another_layout, 2, str(tmp_path / "ck")):
        assert "reads only the rank's own shards" in msg and "use_collectives=True" in msg, msg

"""Save and load on real gloo ranks (2 and 4 processes): round trips, dedup, failures.

Each launch checks several behaviours, because starting ranks is the expensive part.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import Counter, assert_same, local_expected, make_dtensor, make_tensor, stored_chunks, zeros_like_tree
from multiprocess import RankFailure, run_ranks
from safetensors import safe_open
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard

from hyper_parallel.core.distributed_checkpoint import (
    LostContactError,
    RankFailedError,
    StandardPlanner,
    UnsupportedValueError,
    load,
    save,
)

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool]


def build_state(ws: int) -> dict:
    """Everything issue #2 lists, on a 1-d mesh and (for 4 ranks) a 2x2 mesh."""
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
    sd: dict = {"model": {}, "dtypes": {}}
    m = sd["model"]
    m["s0_uneven"] = make_dtensor(make_tensor((7, 5), seed=1), mesh, [Shard(0)])
    m["s1_uneven"] = make_dtensor(make_tensor((3, 7), seed=2), mesh, [Shard(1)])
    m["replicated"] = make_dtensor(make_tensor((4, 4), seed=3), mesh, [Replicate()])
    m["fewer_rows_than_ranks"] = make_dtensor(make_tensor((ws - 1, 3), seed=4), mesh, [Shard(0)])
    m["empty"] = make_dtensor(torch.empty(0, 4), mesh, [Shard(0)])
    m["scalar_tensor"] = torch.tensor(2.5)
    m["plain"] = make_tensor((3, 2), seed=5)
    m["view"] = make_tensor((6, 4), seed=6)[1:5, ::2]  # non-contiguous view with an offset
    if ws == 4:
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        m["2d_s0s1"] = make_dtensor(make_tensor((7, 5), seed=7), mesh2, [Shard(0), Shard(1)])
        m["2d_rs0"] = make_dtensor(make_tensor((5, 3), seed=8), mesh2, [Replicate(), Shard(0)])
        m["2d_s1r"] = make_dtensor(make_tensor((3, 9), seed=9), mesh2, [Shard(1), Replicate()])
    for i, dt in enumerate(DTYPES):
        name = str(dt).replace("torch.", "")
        sd["dtypes"][name] = make_dtensor(make_tensor((5, 3), dt, seed=20 + i), mesh, [Shard(0)])
    sd["values"] = {"step": 7, "lr": 1e-3, "ratio": float("inf"), "name": "run-a", "none": None,
                    "flag": False, "betas": (0.9, 0.999), "ids": [1, 2, 3], "int_keys": {1: "a", 2: "b"}}
    sd["blob"] = b"\x00\x01binary\xff"
    sd["array"] = np.arange(12, dtype=np.float32).reshape(3, 4)
    sd["counter"] = Counter(5)
    sd["list_of_tensors"] = [make_tensor((2,), seed=40), make_tensor((3,), seed=41)]
    return sd


def _plain(sd: dict) -> dict:
    """Expected values with Stateful objects replaced by their state dicts."""
    out = dict(sd)
    out["counter"] = sd["counter"].state_dict()
    return out


def _full(v):
    from torch.distributed.tensor import DTensor
    if isinstance(v, DTensor):
        return v.test_full
    if isinstance(v, torch.Tensor):
        return v.contiguous()
    if isinstance(v, dict):
        return {k: _full(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_full(x) for x in v]
    return v


def rank_roundtrip(rank: int, ws: int, path: str) -> dict:
    sd = build_state(ws)
    expected_full = _full(_plain(sd))
    meta = save(sd, path)
    # 1. in place, same layout: every local shard bit-exact, values replaced, Stateful restored
    target = zeros_like_tree(_plain(sd))
    target["counter"] = Counter(5)
    target["counter"].n, target["counter"].hist = 0, torch.zeros(5)
    target["values"] = {k: None for k in sd["values"]}
    target["blob"] = b""
    out = load(target, checkpoint_id=path)
    assert out is target
    assert target["counter"].n == 5 and torch.equal(target["counter"].hist, sd["counter"].hist)
    target["counter"] = target["counter"].state_dict()
    assert_same(_plain(sd), target)
    # 2. no target: full CPU tensors, nested as saved, types preserved
    full = load(path=path)
    assert_same(expected_full, full)
    dist.barrier()
    if rank != 0:
        return {}
    files = sorted(f for f in os.listdir(path) if not f.startswith("."))
    per_rank: dict[int, int] = {}
    for key in meta.entries:
        for _, r, nbytes in stored_chunks(meta, key):
            per_rank[r] = per_rank.get(r, 0) + nbytes
    return {"files": files, "per_rank": per_rank,
            "replicated_chunks": len(stored_chunks(meta, "model.replicated"))}


@pytest.mark.parametrize("ws", [2, 4])
def test_round_trip_of_every_kind_of_value_is_bit_exact(tmp_path, ws):
    path = str(tmp_path / "ckpt")
    info = run_ranks(rank_roundtrip, ws, path)[0]
    assert info["replicated_chunks"] == 1, "a replicated tensor must be stored once"
    # the checkpoint holds no pickle: JSON metadata, safetensors data files
    doc = json.loads(open(os.path.join(path, ".metadata"), "rb").read())
    assert doc["format"] == "hyper-parallel-dcp" and doc["version"] == 2
    assert all(e["kind"] != "pickle" for e in doc["entries"].values())
    for f in info["files"]:
        assert f.endswith(".safetensors")
        with safe_open(os.path.join(path, f), framework="pt") as g:
            assert len(list(g.keys())) > 0


def rank_dedup(rank: int, ws: int, path: str) -> dict:
    mesh = init_device_mesh("cpu", (ws,))
    sizes = [(64, 33), (17, 5), (128, 8), (3, 3), (40, 40), (9, 100), (1, 1), (50, 20), (70, 7), (11, 13)]
    sd = {f"r{i}": make_dtensor(make_tensor(s, seed=i), mesh, [Replicate()]) for i, s in enumerate(sizes)}
    sd.update({f"p{i}": make_tensor(s, seed=100 + i) for i, s in enumerate(sizes)})  # plain = replicated
    meta = save(sd, path)
    target = zeros_like_tree(sd)
    load(target, path)
    assert_same(sd, target)
    if rank:
        return {}
    per_rank = [0] * ws
    for key in meta.entries:
        chunks = stored_chunks(meta, key)
        assert len(chunks) == 1, f"{key} stored {len(chunks)} times"
        per_rank[chunks[0][1]] += chunks[0][2]
    largest = max(stored_chunks(meta, key)[0][2] for key in meta.entries)
    return {"per_rank": per_rank, "largest": largest}


def test_replicated_data_is_written_once_and_balanced_across_four_ranks(tmp_path):
    info = run_ranks(rank_dedup, 4, str(tmp_path / "ckpt"))[0]
    even = sum(info["per_rank"]) / 4
    assert all(abs(b - even) <= info["largest"] for b in info["per_rank"]), info
    assert all(b > 0 for b in info["per_rank"]), info


class FailingWritePlanner(StandardPlanner):
    """Raises while rank ``bad`` resolves its data, i.e. in the middle of writing."""

    def __init__(self, bad: int):
        super().__init__()
        self.bad = bad

    def resolve_data(self, item):
        if dist.get_rank() == self.bad and item.key == "w":
            raise OSError(28, "No space left on device (injected)")
        return super().resolve_data(item)


def rank_failure(rank: int, ws: int, path: str) -> dict:
    mesh = init_device_mesh("cpu", (ws,))
    old = {"w": make_dtensor(make_tensor((8, 3), seed=1), mesh, [Shard(0)]), "step": 1}
    save(old, path)
    new = {"w": make_dtensor(make_tensor((8, 3), seed=2), mesh, [Shard(0)]), "step": 2}
    try:
        save(new, path, planner=FailingWritePlanner(bad=1))
    except RankFailedError as exc:
        assert 1 in exc.failures and "No space left" in exc.failures[1], str(exc)
        assert "rank" in str(exc)
    else:
        raise AssertionError("save with a failing rank did not raise")
    # the older checkpoint is intact and still loads
    target = zeros_like_tree(old)
    target["step"] = 0
    load(target, path)
    assert target["step"] == 1
    assert torch.equal(target["w"].to_local(), old["w"].to_local())
    dist.barrier()
    return sorted(os.listdir(path))


def rank_failure_fresh_dir(rank: int, ws: int, path: str) -> bool:
    mesh = init_device_mesh("cpu", (ws,))
    sd = {"w": make_dtensor(make_tensor((8, 3)), mesh, [Shard(0)])}
    with pytest.raises(RankFailedError, match="rank"):
        save(sd, path, planner=FailingWritePlanner(bad=0))
    dist.barrier()
    return os.path.exists(os.path.join(path, ".metadata"))


def test_a_rank_failing_mid_write_fails_every_rank_and_keeps_the_old_checkpoint(tmp_path):
    listings = run_ranks(rank_failure, 2, str(tmp_path / "a"))
    # no stray data files of the failed save are left next to the old checkpoint
    assert len([f for f in listings[0] if f.endswith(".safetensors")]) == 2, listings[0]
    flags = run_ranks(rank_failure_fresh_dir, 2, str(tmp_path / "b"))
    assert flags == [False, False], "a failed save must not leave .metadata"


def rank_errors(rank: int, ws: int, path: str) -> str:
    mesh = init_device_mesh("cpu", (ws,))
    full = make_tensor((6, 4))
    sd = {"w": make_dtensor(full, mesh, [Shard(0)]), "b": make_tensor((4,))}
    # Partial placements are refused on every rank
    partial = torch.distributed.tensor.DTensor.from_local(torch.ones(2, 2), mesh, [Partial()], run_check=False)
    with pytest.raises(RankFailedError, match="Partial"):
        save({"p": partial}, path + "_partial")
    save(sd, path)
    # load resharded into a different layout works (Shard(0) -> Shard(1) and Replicate)
    t = {"w": make_dtensor(torch.zeros(6, 4), mesh, [Shard(1)]), "b": torch.zeros(4)}
    load(t, path)
    assert torch.equal(t["w"].to_local(), local_expected(full, mesh, [Shard(1)]))
    # a shape mismatch names the key, on every rank
    bad = {"w": make_dtensor(torch.zeros(6, 5), mesh, [Shard(0)]), "b": torch.zeros(4)}
    with pytest.raises(RankFailedError, match="'w'.*shape"):
        load(bad, path)
    return "ok"


def test_errors_reach_every_rank_and_load_reshards(tmp_path):
    assert run_ranks(rank_errors, 2, str(tmp_path / "ckpt")) == ["ok", "ok"]


def rank_raises(rank: int, ws: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")
    return None


def test_runner_reports_the_failing_rank():
    with pytest.raises(RankFailure, match="boom on rank 1"):
        run_ranks(rank_raises, 2)


def test_unsupported_value_is_refused_without_pickle(tmp_path):
    with pytest.raises(UnsupportedValueError, match="'obj'.*allow_pickle"):
        save({"obj": object()}, str(tmp_path / "c"), no_dist=True)


def rank_hung(rank: int, ws: int, path: str) -> str:
    import time

    from hyper_parallel.core.distributed_checkpoint import CheckpointError
    sd = {"w": make_tensor((4, 4))}
    if rank == 1:
        time.sleep(6)  # a stuck rank: never joins in time
        return "slept"
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="lost contact"):
        save(sd, path, timeout=1.5)
    took = time.monotonic() - t0
    assert took < 5, took
    return "timed out"


def test_a_hung_rank_becomes_an_error_after_the_timeout(tmp_path):
    assert run_ranks(rank_hung, 2, str(tmp_path / "c")) == ["timed out", "slept"]


def rank_reinit(rank: int, ws: int, path: str) -> str:
    from datetime import timedelta
    sd = {"w": make_tensor((4, 4))}
    save(sd, path)
    # a second world in the same process: the checkpoint group of the first one is gone
    dist.destroy_process_group()
    store = dist.FileStore(path + ".store2", ws)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ws, timeout=timedelta(seconds=30))
    save({"w": make_tensor((4, 4), seed=1)}, path)
    out = load(path=path)
    assert torch.equal(out["w"], make_tensor((4, 4), seed=1))
    return "ok"


def test_save_works_again_after_the_process_group_is_recreated(tmp_path):
    assert run_ranks(rank_reinit, 2, str(tmp_path / "c")) == ["ok", "ok"]


def rank_alone(rank: int, ws: int, path: str) -> str:
    mesh = init_device_mesh("cpu", (ws,))
    sharded = {"w": make_dtensor(make_tensor((6, 4)), mesh, [Shard(0)])}
    with pytest.raises(UnsupportedValueError, match="'w'.*saves alone"):
        save(sharded, f"{path}-{rank}", no_dist=True)
    replicated = {"w": make_dtensor(make_tensor((6, 4)), mesh, [Replicate()])}
    save(replicated, f"{path}-{rank}", no_dist=True)  # a full replica: complete alone
    assert torch.equal(load(path=f"{path}-{rank}", no_dist=True)["w"], make_tensor((6, 4)))
    return "ok"


def test_saving_a_shard_alone_is_refused_a_replica_is_fine(tmp_path):
    assert run_ranks(rank_alone, 2, str(tmp_path / "c")) == ["ok", "ok"]


def two_places(rank: int, ws: int, root: str, linked: bool) -> str:
    name = ("real" if rank == 0 else "link") if linked else f"stage{rank}"
    try:
        save({"w": torch.full((1000,), float(rank))}, checkpoint_id=os.path.join(root, name))
    except ValueError as exc:
        return str(exc)
    return "saved"


def test_ranks_saving_together_must_name_one_checkpoint(tmp_path):
    # rank 0 committing metadata that names rank 1's file in another directory would leave a
    # checkpoint that looks complete and cannot load: every rank refuses, nothing is committed
    for msg in run_ranks(two_places, 2, str(tmp_path), False):
        assert "name different checkpoints" in msg and "stage0" in msg and "stage1" in msg, msg
    assert not any(os.path.exists(tmp_path / f"stage{r}" / ".metadata") for r in range(2))
    # two names of one directory (a symlink) are one checkpoint
    os.makedirs(tmp_path / "real")
    os.symlink(tmp_path / "real", tmp_path / "link")
    assert run_ranks(two_places, 2, str(tmp_path), True) == ["saved", "saved"]
    assert load(path=str(tmp_path / "link"))["w"].shape == (1000,)


def save_or_load(rank: int, ws: int, root: str) -> str:
    from hyper_parallel.core.distributed_checkpoint import CheckpointError

    try:
        if rank == 0:
            save({"w": torch.ones(8)}, root)
        else:
            load({"w": torch.zeros(8)}, root)
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def test_ranks_in_different_calls_get_one_clear_error(tmp_path):
    for msg in run_ranks(save_or_load, 2, str(tmp_path / "ck")):
        assert "different calls" in msg and "rank 0 in 'save'" in msg and "rank 1 in 'load'" in msg, msg


def plain_values(rank: int, ws: int, root: str) -> list[str]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save({"w": torch.ones(2), "step": 7, "loader": {"offset": 100 * rank}}, os.path.join(root, "a"))
        save({"w": torch.ones(2), "step": 7, "loader": {"offset": 5}}, os.path.join(root, "b"))
    return [str(w.message) for w in caught if "plain values" in str(w.message)]


def test_plain_values_that_differ_between_ranks_are_named_in_a_warning(tmp_path):
    # the checkpoint keeps one rank's value per key: a per-rank value under a shared key
    # would come back as rank 0's on every rank
    on_coordinator, elsewhere = run_ranks(plain_values, 2, str(tmp_path))
    assert len(on_coordinator) == 1 and "'loader': [0] vs [1]" in on_coordinator[0], on_coordinator
    assert "'step'" not in on_coordinator[0] and elsewhere == []


def rank_loads_nothing(rank: int, ws: int, path: str) -> str:
    save({"a": torch.arange(10.0), "b": torch.ones(3)}, path)
    target = {} if rank == 1 else {"a": torch.zeros(10)}
    try:
        load(target, checkpoint_id=path, timeout=3)
    except LostContactError as exc:
        return str(exc)
    finally:
        if rank == 1:
            time.sleep(6)  # alive, going on with its work, as a training job would
    return "loaded"


def test_a_world_group_load_where_one_rank_has_an_empty_target_fails_naming_it(tmp_path):
    # load({}) takes no part (HyperParallel's ranks outside a rank_list mesh call it), so the
    # others wait for it until their timeout: the error says that is a possible cause
    out = run_ranks(rank_loads_nothing, 2, str(tmp_path / "ck"), timeout_s=90)
    assert out[1] == "loaded" and "empty target" in out[0], out


def rank_local_scalars(rank: int, ws: int, path: str) -> dict:
    save({"step_t": torch.tensor(7.0), "w": torch.arange(4.0), "n": 3}, path, use_collectives=False)
    dist.barrier()  # rank-local saves do not wait for each other
    target = {"step_t": torch.zeros(()), "w": torch.zeros(4), "n": 0}
    load(target, path)  # the fragments read as one checkpoint
    return {"step_t": target["step_t"].item(), "w": target["w"].tolist(), "n": target["n"]}


def test_a_rank_local_checkpoint_with_0_d_tensors_reads_as_one(tmp_path):
    """Merging the ranks' fragments reshaped a 0-d tensor's (empty) boxes with -1 columns."""
    path = str(tmp_path / "ck")
    for out in run_ranks(rank_local_scalars, 2, path):
        assert out == {"step_t": 7.0, "w": [0.0, 1.0, 2.0, 3.0], "n": 3}
    whole = load(path=path, no_dist=True)
    assert whole["step_t"].item() == 7.0 and whole["step_t"].shape == ()


def rank_empty_shards(rank: int, ws: int, root: str) -> dict:
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    src = {"w": distribute_tensor(torch.arange(4.0).reshape(1, 4), mesh, [Shard(0)]),  # rank 1 holds no row
           "v": distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)]),
           "empty": distribute_tensor(torch.zeros(0, 4), mesh, [Shard(0)])}
    save(src, root)
    with torch.device("meta"):  # a model built on meta, loaded with assign=True afterwards
        target = {k: distribute_tensor(torch.empty(v.shape), mesh, [Shard(0)]) for k, v in src.items()}
    load(target, root)
    return {k: (v.to_local().device.type, torch.equal(v.to_local(), src[k].to_local())) for k, v in target.items()}


def test_meta_targets_whose_shard_is_empty_are_materialized_too(tmp_path):
    for out in run_ranks(rank_empty_shards, 2, str(tmp_path / "ck")):
        assert out == {"w": ("cpu", True), "v": ("cpu", True), "empty": ("cpu", True)}, out


def rank_fsdp_tp_empty(rank: int, ws: int, root: str) -> list:
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from hyper_parallel import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.w = torch.nn.Linear(1, 3, bias=False)  # Shard(1) of one column: tp rank 1 holds none of it
    full = m.w.weight.detach().clone()
    parallelize_module(m, mesh["tp"], {"w": RowwiseParallel()})
    fully_shard(m, mesh=mesh["dp"])
    sd = m.state_dict()
    mine = sd["w.weight"].to_local().clone()
    save(sd, os.path.join(root, "fsdp_tp"))
    with torch.no_grad():
        sd["w.weight"].to_local().zero_()
    load(sd, os.path.join(root, "fsdp_tp"))
    whole = load(path=os.path.join(root, "fsdp_tp"), no_dist=True)["w.weight"]
    return [tuple(mine.shape), torch.equal(sd["w.weight"].to_local(), mine), torch.equal(whole, full)]


def test_fsdp2_tp_ranks_holding_no_part_of_a_tensor_save_and_load(tmp_path):
    """FSDP2 gives a rank with none of a TP shard a (0, 0) local tensor, not the (n, 0) its
    placements describe: nothing to save or read, which was refused as a shape mismatch."""
    outs = run_ranks(rank_fsdp_tp_empty, 4, str(tmp_path), timeout_s=180)
    assert [o[1:] for o in outs] == [[True, True]] * 4
    assert sorted(o[0] for o in outs) == [(0, 0), (0, 0), (1, 1), (2, 1)]

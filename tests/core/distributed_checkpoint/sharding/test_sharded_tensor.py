"""ShardedTensor (torch's legacy sharded value: FSDP1 SHARDED_STATE_DICT, torchrec): saved as
its shards, loaded in place, resharded to and from plain tensors, DTensors and other shard
layouts, bit-exact.

Two real gloo ranks, in one launch whose checks the tests below read by name: ShardedTensors of
three layouts (torch's ChunkShardingSpec, uneven; several uneven 2-D blocks per rank; every
shard on one rank) are saved and loaded into plain tensors, DTensors (Shard(0), Shard(1),
Replicate) and ShardedTensors of other layouts, each local shard filled in place; DTensor and
plain saves load into ShardedTensors; a dtype conversion, an async save, a rank-local save; a
real FSDP1 model's SHARDED_STATE_DICT saved and loaded into a fresh FSDP1 model and into a
plain module; overlapping shards and the local tier refused naming the key. Then this process
reads a checkpoint offline: one table row per shard, whole tensors.
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import bits, make_tensor
from multiprocess import run_ranks

from hyper_parallel.core.distributed_checkpoint import FileSystemReader, async_save, load, save
from hyper_parallel.core.distributed_checkpoint._src.format import metadata as md

TENSORS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "a": ((7, 6), torch.float32),
    "b": ((5,), torch.int64),
    "c": ((4, 3, 2), torch.bfloat16),
}

# layout -> key -> [(rank, offsets, sizes)]; "rows" and "cols" are torch's ChunkShardingSpec
SEVERAL = {  # several uneven shards per rank, in no particular order
    "a": [(0, (0, 0), (2, 6)), (1, (2, 0), (3, 6)), (0, (5, 0), (2, 3)), (1, (5, 3), (2, 3))],
    "b": [(1, (0,), (1,)), (0, (1,), (2,)), (1, (3,), (2,))],
    "c": [(0, (0, 0, 0), (4, 1, 2)), (1, (0, 1, 0), (4, 2, 1)), (0, (0, 1, 1), (4, 2, 1))],
}
ONE_RANK = {k: [(1, (0,) * len(shape), shape)] for k, (shape, _) in TENSORS.items()}  # rank 0 holds none


def full(key: str) -> torch.Tensor:
    shape, dtype = TENSORS[key]
    return make_tensor(shape, dtype, seed=sorted(TENSORS).index(key) + 1)


def _region(t: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]


def _explicit(key: str, shards: list[tuple[int, tuple, tuple]], rank: int, fill: bool,
              dtype: torch.dtype | None = None) -> Any:
    """A ShardedTensor of ``key`` with the given shards (global ranks), built as torch builds
    one from local shards and global metadata."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    shape, saved_dtype = TENSORS[key]
    dtype = dtype or saved_dtype
    metas = [ShardMetadata(list(o), list(s), f"rank:{r}/cpu") for r, o, s in shards]
    local = []
    for (r, o, s), m in zip(shards, metas, strict=True):
        if r == rank:
            data = _region(full(key), o, s).to(dtype).clone() if fill else torch.zeros(s, dtype=dtype)
            local.append(Shard(data, m))
    meta = ShardedTensorMetadata(metas, torch.Size(shape), TensorProperties(dtype=dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta)


def _chunked(key: str, dim: int, rank: int, fill: bool, reverse: bool = False) -> Any:
    """A ShardedTensor of ``key`` made by torch's ChunkShardingSpec (uneven when the dim is)."""
    from torch.distributed._shard import sharded_tensor as st
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    shape, dtype = TENSORS[key]
    ranks = [1, 0] if reverse else [0, 1]
    t = st.zeros(ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in ranks]), *shape, dtype=dtype)
    if fill:
        for s in t.local_shards():
            s.tensor.copy_(_region(full(key), tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)))
    return t


def make(layout: str, key: str, rank: int, fill: bool = True) -> Any:
    if layout == "rows":
        return _chunked(key, 0, rank, fill)
    if layout == "cols":  # a 1-d tensor: its rows, rank 1 first
        return _chunked(key, 1 if len(TENSORS[key][0]) > 1 else 0, rank, fill, reverse=len(TENSORS[key][0]) == 1)
    return _explicit(key, {"several": SEVERAL, "one_rank": ONE_RANK}[layout][key], rank, fill)


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (got.dtype, got.shape, want.shape)
    assert torch.equal(bits(got), bits(want)), "values differ"


def _check_shards(key: str, t: Any) -> None:
    """Every local shard of ``t`` holds its region of ``full(key)`` (in ``t``'s dtype)."""
    for s in t.local_shards():
        want = _region(full(key), tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes))
        _same(s.tensor, want.to(s.tensor.dtype))


def _check(results: dict[str, str], name: str, fn: Callable[[], None]) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch: "Please use DTensor instead"
            fn()
        results[name] = "ok"
    except Exception:
        results[name] = traceback.format_exc()


SOURCES = ["rows", "several", "one_rank"]
TARGETS = ["rows", "cols", "several", "one_rank"]


def _two_ranks(rank: int, ws: int, root: str) -> dict[str, str]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    warnings.simplefilter("ignore", FutureWarning)
    mesh = init_device_mesh("cpu", (2,))
    out: dict[str, str] = {}
    for src in SOURCES:
        d = os.path.join(root, src)
        _check(out, f"save_{src}", lambda d=d, src=src: save({k: make(src, k, rank) for k in TENSORS}, checkpoint_id=d))
        dist.barrier()

        def to_plain(d: str = d) -> None:
            target = {k: torch.zeros_like(full(k)) for k in TENSORS}
            load(target, checkpoint_id=d)
            for k, t in target.items():
                _same(t, full(k))

        _check(out, f"{src}_to_plain", to_plain)
        for name, placements in (("shard0", [Shard(0)]), ("shard1", [Shard(1)]), ("replicate", [Replicate()])):
            def to_dtensor(d: str = d, placements: list = placements) -> None:
                keys = [k for k in TENSORS if placements[0] != Shard(1) or len(TENSORS[k][0]) > 1]
                target = {k: distribute_tensor(torch.zeros_like(full(k)), mesh, placements) for k in keys}
                load(target, checkpoint_id=d)
                for k, t in target.items():
                    _same(t.to_local(), distribute_tensor(full(k), mesh, placements).to_local())

            _check(out, f"{src}_to_{name}", to_dtensor)
        for dst in TARGETS:
            def to_sharded(d: str = d, dst: str = dst) -> None:
                target = {k: make(dst, k, rank, fill=False) for k in TENSORS}
                before = {k: [s.tensor.data_ptr() for s in t.local_shards()] for k, t in target.items()}
                load(target, checkpoint_id=d)
                for k, t in target.items():
                    assert [s.tensor.data_ptr() for s in t.local_shards()] == before[k]  # filled in place
                    _check_shards(k, t)

            _check(out, f"{src}_to_sharded_{dst}", to_sharded)

    # DTensor and plain saves -> ShardedTensor targets
    for name, state in (("dtensor", lambda: {k: distribute_tensor(full(k), mesh, [Shard(0)]) for k in TENSORS}),
                        ("plain", lambda: {k: full(k) for k in TENSORS})):
        d = os.path.join(root, name)
        save(state(), checkpoint_id=d)
        for dst in ("several", "cols"):
            def from_layout(d: str = d, dst: str = dst) -> None:
                target = {k: make(dst, k, rank, fill=False) for k in TENSORS}
                load(target, checkpoint_id=d)
                for k, t in target.items():
                    _check_shards(k, t)

            _check(out, f"{name}_to_sharded_{dst}", from_layout)

    def dtype_converted() -> None:
        target = {"a": _explicit("a", SEVERAL["a"], rank, fill=False, dtype=torch.float64)}
        load(target, checkpoint_id=os.path.join(root, "rows"))
        _check_shards("a", target["a"])

    _check(out, "dtype_converted", dtype_converted)

    def asynchronous() -> None:
        d = os.path.join(root, "async")
        state = {"model": {k: make("several", k, rank) for k in TENSORS}, "step": 3}
        resp = async_save(state, checkpoint_id=d)
        for t in state["model"].values():  # the snapshot is taken: training may change its shards
            for s in t.local_shards():
                s.tensor.zero_()
        resp.result()
        target = {"model": {k: torch.zeros_like(full(k)) for k in TENSORS}, "step": 0}
        load(target, checkpoint_id=d)
        assert target["step"] == 3
        for k, t in target["model"].items():
            _same(t, full(k))

    _check(out, "async_save", asynchronous)

    def rank_local() -> None:  # use_collectives=False: each rank's fragment holds its own shards
        d = os.path.join(root, "rank_local")
        save({k: make("several", k, rank) for k in TENSORS}, checkpoint_id=d, use_collectives=False)
        target = {k: make("several", k, rank, fill=False) for k in TENSORS}
        load(target, checkpoint_id=d, use_collectives=False)
        for k, t in target.items():
            _check_shards(k, t)

    _check(out, "rank_local_save_and_load", rank_local)

    def fsdp1() -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType

        def model(seed: int) -> torch.nn.Module:
            torch.manual_seed(seed)
            return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))

        d = os.path.join(root, "fsdp1")
        src = FSDP(model(0), device_id=torch.device("cpu"), use_orig_params=True)
        with FSDP.state_dict_type(src, StateDictType.SHARDED_STATE_DICT):
            sd = src.state_dict()
            assert all(type(v).__name__ == "ShardedTensor" for v in sd.values()), {k: type(v) for k, v in sd.items()}
            save({"model": sd}, checkpoint_id=d)
        dst = FSDP(model(1), device_id=torch.device("cpu"), use_orig_params=True)
        with FSDP.state_dict_type(dst, StateDictType.SHARDED_STATE_DICT):
            sd = dst.state_dict()
            load({"model": sd}, checkpoint_id=d)
            dst.load_state_dict(sd)
        plain = model(2)
        state = {"model": plain.state_dict()}
        load(state, checkpoint_id=d)
        with FSDP.summon_full_params(src), FSDP.summon_full_params(dst):
            for a, b, c in zip(src.parameters(), dst.parameters(), plain.parameters(), strict=True):
                _same(b.detach(), a.detach())
                _same(c.detach(), a.detach())

    _check(out, "fsdp1_sharded_state_dict", fsdp1)

    def refused(bad: Any, words: str) -> None:
        try:
            save({"w": bad}, checkpoint_id=os.path.join(root, "refused"))
        except Exception as exc:
            assert "'w'" in str(exc) and words in str(exc), str(exc)
        else:
            raise AssertionError(f"shards {bad.metadata().shards_metadata} were saved")

    # torch refuses to build such ShardedTensors; their metadata is changed after the fact
    def overlapping() -> None:
        bad = _explicit("b", [(0, (0,), (3,)), (1, (3,), (2,))], rank, fill=True)
        bad.metadata().shards_metadata[1].shard_offsets = [2]  # element 2 twice
        refused(bad, "overlap")

    def with_a_gap() -> None:
        bad = _explicit("b", [(0, (0,), (3,)), (1, (3,), (2,))], rank, fill=True)
        bad.metadata().shards_metadata[1].shard_offsets = [4]
        bad.metadata().shards_metadata[1].shard_sizes = [1]  # element 3 in no shard
        refused(bad, "cover the whole tensor")

    _check(out, "overlapping_shards_refused", overlapping)
    _check(out, "shards_with_a_gap_refused", with_a_gap)

    def local_tier_refused() -> None:
        from hyper_parallel.core.distributed_checkpoint._src.base.errors import UnsupportedValueError
        from hyper_parallel.core.distributed_checkpoint._src.manager.local_format import describe
        from hyper_parallel.core.distributed_checkpoint._src.state.flatten import flatten

        with pytest.raises(UnsupportedValueError, match="'w': a ShardedTensor cannot be kept in the local tier"):
            describe(flatten({"w": make("rows", "a", rank)}))

    _check(out, "local_tier_refused", local_tier_refused)
    return out


CHECKS = ([f"save_{s}" for s in SOURCES]
          + [f"{s}_to_{t}" for s in SOURCES for t in ("plain", "shard0", "shard1", "replicate")]
          + [f"{s}_to_sharded_{t}" for s in SOURCES for t in TARGETS]
          + [f"{s}_to_sharded_{t}" for s in ("dtensor", "plain") for t in ("several", "cols")]
          + ["dtype_converted", "async_save", "rank_local_save_and_load", "fsdp1_sharded_state_dict",
             "overlapping_shards_refused", "shards_with_a_gap_refused", "local_tier_refused"])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[str, list[dict[str, str]]]:
    root = str(tmp_path_factory.mktemp("sharded_tensor"))
    return root, run_ranks(_two_ranks, 2, root, timeout_s=300)


@pytest.mark.parametrize("check", CHECKS)
def test_two_ranks(two_ranks, check):
    _, results = two_ranks
    for rank, res in enumerate(results):
        assert res.get(check) == "ok", f"rank {rank}: {res.get(check)}"


def test_each_shard_is_one_saved_chunk_and_any_reader_loads_whole_tensors(two_ranks):
    root, _ = two_ranks
    d = os.path.join(root, "several")
    meta = md.Metadata.from_json(FileSystemReader(d).read_metadata_bytes())
    for k, shards in SEVERAL.items():
        entry = meta.entries[k]
        assert entry.layout is None and isinstance(entry.store, md.TableStore)
        assert entry.shape == TENSORS[k][0] and entry.dtype == str(TENSORS[k][1]).removeprefix("torch.")
        assert sorted(entry.store.distinct_boxes()) == sorted((o, s) for _, o, s in shards)
        assert len(entry.store) == len(shards)  # each shard written once, by its holder
    for src in ("several", "one_rank", "rank_local", "async"):
        got = load(path=os.path.join(root, src))  # one process, no process group: whole tensors
        for k in TENSORS:
            _same(got["model"][k] if src == "async" else got[k], full(k))

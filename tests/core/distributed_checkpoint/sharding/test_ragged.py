"""RaggedShard (HyperParallel's flat, uneven shard): saved as ordinary boxes, loaded and
resharded to and from Shard/Replicate layouts, bit-exact.

One process: the flat-range -> boxes decomposition (exhaustive on small shapes, property
style), the placement's checks, and HyperParallel's helpers. Two real gloo ranks, in one launch
whose checks the tests below read by name: save RaggedShard and load as Shard(0), Shard(1),
Replicate, plain tensors and other RaggedShard units (an empty rank included), save
Shard/Replicate and load into RaggedShard, async_save a RaggedShard state, a replicated
RaggedShard on a (2, 1) mesh; then this process reads the checkpoint offline (no process
group): a whole-tensor load, the metadata (no layout, table stores, every box once) and an
offline reshard to a Shard(0) layout.
"""

from __future__ import annotations

import math
import os
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import bits, make_tensor
from multiprocess import run_ranks

from hyper_parallel.core.distributed_checkpoint import FileSystemReader, Layout, async_save, load, save
from hyper_parallel.core.distributed_checkpoint._src.format import metadata as md
from hyper_parallel.core.distributed_checkpoint._src.resharding.reshard import reshard
from hyper_parallel.core.distributed_checkpoint._src.sharding.ragged import flat_range_boxes, rank_flat_range
from hyper_parallel.core.distributed_checkpoint.ragged_utils import (
    _decompose_flat_interval,
    compute_ragged_boxes,
    create_ragged_write_items,
    get_ragged_box_tensor,
)
from hyper_parallel.core.dtensor.placement_types import RaggedShard

# key -> (shape, dtype, dims, saved local_units); the values are make_tensor(shape, dtype, seed)
TENSORS: dict[str, tuple[tuple[int, ...], torch.dtype, tuple[int, ...], tuple[int, ...]]] = {
    "a": ((6, 4, 8), torch.float32, (0, 1), (1, 3)),  # rank 0's run crosses a dim-0 slab: 2 boxes
    "b": ((5, 3), torch.float32, (0,), (0, 1)),  # rank 0 holds nothing
    "c": ((4, 6), torch.bfloat16, (0, 1), (3, 5)),  # runs of 9 and 15 elements of 6-wide rows
    "d": ((3, 5, 7), torch.int64, (0, 1, 2), (4, 1)),  # element-wise units, runs cut every dim
}
# other units to load into (ragged -> ragged)
RELOAD_UNITS = {"a": (3, 1), "b": (1, 0), "c": (1, 1), "d": (2, 3)}


def full(key: str) -> torch.Tensor:
    shape, dtype, _, _ = TENSORS[key]
    return make_tensor(shape, dtype, seed=sorted(TENSORS).index(key) + 1)


def run_of(key: str, units: tuple[int, ...], index: int) -> torch.Tensor:
    """The flat run of rank ``index`` under ``units``, from the full tensor."""
    shape, _, dims, _ = TENSORS[key]
    start, end = rank_flat_range(shape, RaggedShard(dims, units), index)
    return full(key).reshape(-1)[start:end]


# ---------------------------------------------------------------------- one process


@pytest.mark.parametrize("shape", [(7,), (2, 3), (2, 3, 2), (3, 2, 2), (2, 3, 4), (1, 1, 3), (3, 1, 2, 2), (2, 0, 3)])
def test_boxes_of_a_flat_range_hold_exactly_its_elements_in_order(shape):
    n = math.prod(shape)
    values = torch.arange(n).reshape(shape)
    for start in range(n + 1):
        for end in range(start, n + 1):
            boxes = flat_range_boxes(shape, start, end)
            got = [v for b in boxes for v in values[tuple(slice(o, o + s) for o, s in
                                                           zip(b.offsets, b.sizes, strict=True))].reshape(-1).tolist()]
            assert got == list(range(start, end)), (start, end, boxes)
            assert len(boxes) <= 2 * len(shape) - 1
            assert all(b.numel for b in boxes)  # no empty boxes


def test_a_row_aligned_range_is_one_box():
    assert [(b.offsets, b.sizes) for b in flat_range_boxes((6, 4, 8), 32, 128)] == [((1, 0, 0), (3, 4, 8))]
    assert flat_range_boxes((6, 4, 8), 5, 5) == []


def test_a_range_outside_the_tensor_or_a_scalar_is_refused():
    with pytest.raises(ValueError, match="outside the 12 elements"):
        flat_range_boxes((3, 4), 2, 13)
    with pytest.raises(ValueError, match="at least one dim"):
        flat_range_boxes((), 0, 0)


def test_the_seed_decomposition_gives_offsets_and_sizes():
    assert _decompose_flat_interval((3, 4), 2, 8) == (((0, 2), (1, 2)), ((1, 0), (1, 4)))


def test_runs_follow_the_units_of_the_leading_dims():
    p = RaggedShard((0, 1), (1, 3))
    assert [rank_flat_range((6, 4, 8), p, i) for i in range(2)] == [(0, 48), (48, 192)]
    assert rank_flat_range((5, 3), RaggedShard((0,), (0, 1)), 0) == (0, 0)


@pytest.mark.parametrize(("dims", "units", "match"), [
    ((1,), (1, 1), "leading dims"), ((), (1,), "non-empty"), ((0,), (), "local_units"),
    ((0,), (1, -1), "non-negative"), ((0,), (0, 0), "positive sum"),
])
def test_the_placement_refuses_what_the_seed_refuses(dims, units, match):
    with pytest.raises(ValueError, match=match):
        RaggedShard(dims, units)


def test_units_that_do_not_divide_the_prefix_are_refused_naming_both():
    with pytest.raises(ValueError, match="multiple of sum"):
        rank_flat_range((5, 3), RaggedShard((0,), (1, 1)), 0)


def test_the_placement_compares_by_value_and_is_a_torch_placement():
    from torch.distributed.tensor.placement_types import Placement

    p = RaggedShard((0,), (1, 2))
    assert isinstance(p, Placement) and p.is_ragged_shard()
    assert p == RaggedShard((0,), (1, 2)) and p != RaggedShard((0,), (2, 1))
    assert hash(p) == hash(RaggedShard((0,), (1, 2)))
    assert repr(p) == "RaggedShard(dims=(0,), local_units=(1, 2))"


def _one_rank_mesh():
    from hyper_parallel.core.dtensor.device_mesh import _DEVICE_MESH_MAP
    from hyper_parallel.core.dtensor.layout import Layout as DLayout

    _DEVICE_MESH_MAP.clear()
    return DLayout((2,), ("ragged",), init_backend=False).mesh  # this process is rank 0 of it


def test_a_ragged_dtensor_keeps_its_flat_local_tensor_and_global_shape():
    from torch.distributed.tensor import DTensor

    t = DTensor.from_local(torch.arange(48.0), _one_rank_mesh(), (RaggedShard((0, 1), (1, 3)),), shape=(6, 4, 8))
    assert tuple(t.shape) == (6, 4, 8) and tuple(t.to_local().shape) == (48,)
    assert compute_ragged_boxes(t) == (((0, 0, 0), (1, 4, 8), 0, 32), ((1, 0, 0), (1, 2, 8), 32, 48))
    items = create_ragged_write_items("w", t)
    assert [tuple(i.index.offset) for i in items] == [(0, 0, 0), (1, 0, 0)]
    assert torch.equal(get_ragged_box_tensor(t, items[1].index).reshape(-1), torch.arange(32.0, 48.0))


def test_a_local_tensor_of_the_wrong_size_is_refused_naming_the_run():
    from torch.distributed.tensor import DTensor

    t = DTensor.from_local(torch.arange(40.0), _one_rank_mesh(), (RaggedShard((0, 1), (1, 3)),), shape=(6, 4, 8))
    with pytest.raises(ValueError, match=r"flat range \[0, 48\)"):
        compute_ragged_boxes(t)


# ---------------------------------------------------------------------- two gloo ranks


def _ragged(mesh: Any, key: str, units: tuple[int, ...], rank: int, fill: bool = True) -> Any:
    from torch.distributed.tensor import DTensor

    shape, dtype, dims, _ = TENSORS[key]
    run = run_of(key, units, rank).clone()
    local = run if fill else torch.zeros_like(run)
    return DTensor.from_local(local, mesh, (RaggedShard(dims, units),), shape=shape)


def _check(results: dict[str, str], name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
        results[name] = "ok"
    except Exception:
        results[name] = traceback.format_exc()


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (got.dtype, got.shape, want.shape)
    assert torch.equal(bits(got), bits(want)), "values differ"


def _two_ranks(rank: int, ws: int, root: str) -> dict[str, str]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    out: dict[str, str] = {}
    ragged_dir = os.path.join(root, "ragged")
    saved = {k: _ragged(mesh, k, TENSORS[k][3], rank) for k in TENSORS}
    save(saved, checkpoint_id=ragged_dir)
    dist.barrier()

    def into(placements: list) -> None:
        target = {k: distribute_tensor(torch.zeros_like(full(k)), mesh, placements) for k in TENSORS
                  if not (placements[0] == Shard(1) and len(TENSORS[k][0]) < 2)}
        load(target, checkpoint_id=ragged_dir)
        for k, t in target.items():
            want = distribute_tensor(full(k), mesh, placements).to_local()
            _same(t.to_local(), want)

    _check(out, "ragged_to_shard0", lambda: into([Shard(0)]))
    _check(out, "ragged_to_shard1", lambda: into([Shard(1)]))
    _check(out, "ragged_to_replicate", lambda: into([Replicate()]))

    def to_plain() -> None:
        target = {k: torch.zeros_like(full(k)) for k in TENSORS}
        load(target, checkpoint_id=ragged_dir)
        for k, t in target.items():
            _same(t, full(k))

    _check(out, "ragged_to_plain", to_plain)

    def to_other_units() -> None:
        target = {k: _ragged(mesh, k, RELOAD_UNITS[k], rank, fill=False) for k in TENSORS}
        load(target, checkpoint_id=ragged_dir)
        for k, t in target.items():
            _same(t.to_local(), run_of(k, RELOAD_UNITS[k], rank))

    _check(out, "ragged_to_other_units", to_other_units)

    def same_units_in_place() -> None:
        target = {k: _ragged(mesh, k, TENSORS[k][3], rank, fill=False) for k in TENSORS}
        locals_before = {k: t.to_local().data_ptr() for k, t in target.items()}
        load(target, checkpoint_id=ragged_dir)
        for k, t in target.items():
            assert t.to_local().data_ptr() == locals_before[k]  # filled in place
            _same(t.to_local(), run_of(k, TENSORS[k][3], rank))

    _check(out, "ragged_to_same_units_in_place", same_units_in_place)

    def dtype_converted() -> None:
        target = {"a": DTensor.from_local(torch.zeros(run_of("a", (3, 1), rank).numel(), dtype=torch.float64),
                                          mesh, (RaggedShard((0, 1), (3, 1)),), shape=(6, 4, 8))}
        load(target, checkpoint_id=ragged_dir)
        _same(target["a"].to_local(), run_of("a", (3, 1), rank).double())

    _check(out, "ragged_dtype_converted", dtype_converted)

    # Shard(0) and Replicate saves -> RaggedShard targets
    for name, placements in (("shard0", [Shard(0)]), ("replicate", [Replicate()])):
        d = os.path.join(root, name)
        save({k: distribute_tensor(full(k), mesh, placements) for k in TENSORS}, checkpoint_id=d)

        def from_layout(d: str = d) -> None:
            target = {k: _ragged(mesh, k, RELOAD_UNITS[k], rank, fill=False) for k in TENSORS}
            load(target, checkpoint_id=d)
            for k, t in target.items():
                _same(t.to_local(), run_of(k, RELOAD_UNITS[k], rank))

        _check(out, f"{name}_to_ragged", from_layout)

    def asynchronous() -> None:
        d = os.path.join(root, "async")
        state = {"model": {k: _ragged(mesh, k, TENSORS[k][3], rank) for k in TENSORS}, "step": 3}
        resp = async_save(state, checkpoint_id=d)
        for t in state["model"].values():  # the snapshot is taken: training may change its tensors
            t.to_local().zero_()
        resp.result()
        target = {"model": {k: distribute_tensor(torch.zeros_like(full(k)), mesh, [Replicate()]) for k in TENSORS},
                  "step": 0}
        load(target, checkpoint_id=d)
        assert target["step"] == 3
        for k, t in target["model"].items():
            _same(t.to_local(), full(k))
        meta = md.Metadata.from_json(FileSystemReader(d).read_metadata_bytes())
        for k in TENSORS:
            assert meta.entries[f"model.{k}"].shape == TENSORS[k][0]

    _check(out, "async_save_keeps_global_shape", asynchronous)

    def replicated_ragged() -> None:  # RaggedShard on a mesh dim of 1, replicated over the other
        mesh2 = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "rs"))
        shape, _, dims, _ = TENSORS["c"]
        t = DTensor.from_local(full("c").reshape(-1).clone(), mesh2, (Replicate(), RaggedShard(dims, (1,))),
                               shape=shape)
        d = os.path.join(root, "replicated")
        save({"c": t}, checkpoint_id=d)
        target = {"c": distribute_tensor(torch.zeros_like(full("c")), mesh, [Shard(0)])}
        load(target, checkpoint_id=d)
        _same(target["c"].to_local(), distribute_tensor(full("c"), mesh, [Shard(0)]).to_local())

    _check(out, "replicated_ragged", replicated_ragged)

    def mixed_with_shard_refused() -> None:
        mesh2 = init_device_mesh("cpu", (1, 2), mesh_dim_names=("rs", "tp"))
        t = DTensor.from_local(torch.zeros(30), mesh2, (RaggedShard((0,), (1,)), Shard(1)), shape=(6, 10))
        try:
            save({"w": t}, checkpoint_id=os.path.join(root, "refused"))
        except Exception as exc:
            assert "'w'" in str(exc) and "only Replicate" in str(exc), str(exc)
        else:
            raise AssertionError("a RaggedShard beside a Shard was saved")

    _check(out, "ragged_beside_shard_refused", mixed_with_shard_refused)

    def rank_local() -> None:  # use_collectives=False: each rank's fragment is a table of its boxes
        d = os.path.join(root, "rank_local")
        save({k: _ragged(mesh, k, TENSORS[k][3], rank) for k in TENSORS}, checkpoint_id=d, use_collectives=False)
        target = {k: _ragged(mesh, k, TENSORS[k][3], rank, fill=False) for k in TENSORS}
        load(target, checkpoint_id=d, use_collectives=False)
        for k, t in target.items():
            _same(t.to_local(), run_of(k, TENSORS[k][3], rank))

    _check(out, "rank_local_save_and_load", rank_local)
    return out


CHECKS = ["ragged_to_shard0", "ragged_to_shard1", "ragged_to_replicate", "ragged_to_plain", "ragged_to_other_units",
          "ragged_to_same_units_in_place", "ragged_dtype_converted", "shard0_to_ragged", "replicate_to_ragged",
          "async_save_keeps_global_shape", "replicated_ragged", "ragged_beside_shard_refused",
          "rank_local_save_and_load"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[str, list[dict[str, str]]]:
    root = str(tmp_path_factory.mktemp("ragged"))
    return root, run_ranks(_two_ranks, 2, root, timeout_s=240)


@pytest.mark.parametrize("check", CHECKS)
def test_two_ranks(two_ranks, check):
    _, results = two_ranks
    for rank, res in enumerate(results):
        assert res.get(check) == "ok", f"rank {rank}: {res.get(check)}"


def test_the_saved_checkpoint_is_ordinary_boxes_any_reader_loads(two_ranks):
    root, _ = two_ranks
    d = os.path.join(root, "ragged")
    meta = md.Metadata.from_json(FileSystemReader(d).read_metadata_bytes())
    for k, (shape, _, dims, units) in TENSORS.items():
        entry = meta.entries[k]
        assert entry.layout is None and isinstance(entry.store, md.TableStore)
        want = [(b.offsets, b.sizes) for i in range(2)
                for b in flat_range_boxes(shape, *rank_flat_range(shape, RaggedShard(dims, units), i))]
        assert entry.store.distinct_boxes() == want and len(entry.store) == len(want)  # each box once
    got = load(path=d)  # one process, no process group: whole tensors
    for k in TENSORS:
        _same(got[k], full(k))
    whole = load(path=os.path.join(root, "rank_local"))  # the fragments, merged by a one-process reader
    for k in TENSORS:
        _same(whole[k], full(k))
    rep = md.Metadata.from_json(FileSystemReader(os.path.join(root, "replicated")).read_metadata_bytes()).entries["c"]
    assert len(rep.store) == len(rep.store.distinct_boxes())  # a replicated run is written once


def test_an_offline_reshard_turns_ragged_boxes_into_a_shard_layout(two_ranks, tmp_path):
    root, _ = two_ranks
    from torch.distributed.tensor import Shard

    layout = Layout((2,), ("dp",))
    reshard(os.path.join(root, "ragged"), str(tmp_path / "s0"), dst_mesh=layout,
            rules={k: layout([Shard(0)]) for k in TENSORS})
    meta = md.Metadata.from_json(FileSystemReader(str(tmp_path / "s0")).read_metadata_bytes())
    for k in TENSORS:
        assert meta.entries[k].layout["placements"] == ["S(0)"]
    got = load(path=str(tmp_path / "s0"))
    for k in TENSORS:
        _same(got[k], full(k))

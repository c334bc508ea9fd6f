"""Layout: HyperParallel tensor_map semantics, torch placements, dict/JSON, and DTensor's boxes."""

from __future__ import annotations

import contextlib
import io
import itertools
import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import (
    _compute_local_shape_and_global_offset,
    compute_local_shape_and_global_offset,
)
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from hyper_parallel.core.distributed_checkpoint import (
    Layout,
    LayoutStrategy,
    TensorLayout,
    get_current_layout,
    load_layout,
    save_layout,
)
from hyper_parallel.core.distributed_checkpoint._src.base.box import Box, uncovered
from hyper_parallel.core.distributed_checkpoint._src.sharding.records import layout_record


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int):
    """Pretend to be ``rank`` of ``world_size`` (collectives are no-ops); always torn down."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


MESH = Layout((2, 4), ("dp", "tp"))


def test_tensor_map_counts_mesh_dims_from_the_last():
    assert MESH("tp", "None").tensor_map == (0, -1)
    assert MESH("None", "tp").tensor_map == (-1, 0)
    assert MESH("dp", "tp").tensor_map == (1, 0)
    assert MESH("None", "None").tensor_map == (-1, -1)
    assert MESH(("dp", "tp"), "None").tensor_map == ((1, 0), -1)
    assert MESH(("tp", "dp"), "None").tensor_map == ((0, 1), -1)
    # and back: tensor_map -> the same layout, alias names as given
    for tl in [MESH("tp", "None"), MESH("dp", "tp"), MESH(("dp", "tp"), "None", "None")]:
        assert TensorLayout.from_tensor_map(MESH, tl.tensor_map) == tl
    assert MESH(("dp", "tp"), "None").alias_map == (("dp", "tp"), "None")


def test_alias_entries_and_torch_placements_describe_the_same_layout():
    assert MESH("tp", "None").placements == (Replicate(), Shard(0))
    assert MESH("dp", "tp").placements == (Shard(0), Shard(1))
    assert MESH("None", "dp").placements == (Shard(1), Replicate())
    # a dim split over two mesh dims in mesh order is torch's [Shard(d), Shard(d)] ...
    assert MESH(("dp", "tp"), "None").placements == (Shard(0), Shard(0))
    # ... and in the other order (FSDP on top of TP) a strided shard
    assert MESH(("tp", "dp"), "None").placements == (_StridedShard(0, split_factor=4), Shard(0))
    for tl in [MESH("tp", "None"), MESH("dp", "tp"), MESH(("dp", "tp"), "None"), MESH(("tp", "dp"), "None")]:
        assert MESH(list(tl.placements), ndim=2) == tl
        assert TensorLayout.from_placements(MESH, tl.to_placements(), ndim=2) == tl
    # placements without ndim: boxes work, tensor_map asks for ndim
    loose = MESH([Replicate(), Shard(0)])
    assert loose.chunk_box(1, (8, 3)) == MESH("tp", "None").chunk_box(1, (8, 3))
    with pytest.raises(ValueError, match="ndim"):
        _ = loose.tensor_map
    assert loose.with_ndim(2).tensor_map == (0, -1)
    assert MESH(Replicate(), Shard(-1), ndim=3).tensor_map == (-1, -1, 0)


def test_layout_of_a_device_mesh_mapping_or_layout():
    assert Layout.of({"dp": 2, "tp": 4}) == MESH
    assert Layout.of(MESH) is MESH
    assert Layout.of(MESH("tp", "None")) is MESH
    with pytest.raises(TypeError, match="DeviceMesh"):
        Layout.of(8)
    with pytest.raises(RuntimeError, match="process group"):
        MESH.to_device_mesh()
    with fake_rank(5, 8):
        mesh = MESH.to_device_mesh()
        assert tuple(mesh.shape) == (2, 4) and mesh.mesh_dim_names == ("dp", "tp")
        assert Layout.from_device_mesh(mesh) == MESH
        assert MESH.coordinate(5) == tuple(mesh.get_coordinate())


def test_rank_list_maps_mesh_positions_to_global_ranks():
    mesh = Layout((2, 2), ("dp", "tp"), rank_list=[4, 5, 6, 7])
    assert mesh.coordinate(6) == (1, 0)
    tl = mesh("tp", "None")
    assert tl.chunk_box(5, (4, 2)) == Box((2, 0), (2, 2))
    assert tl.holders((4, 2)) == {Box((0, 0), (2, 2)): [4, 6], Box((2, 0), (2, 2)): [5, 7]}
    with pytest.raises(ValueError, match="rank 0 is not in this mesh"):
        tl.chunk_box(0, (4, 2))


@pytest.mark.parametrize("tl", [
    MESH("tp", "None"),
    MESH(("tp", "dp"), "None"),
    MESH("None", "None", "dp"),
    Layout((2, 2), ("a", "b"), rank_list=[3, 2, 1, 0])("b", "a"),
    MESH([Shard(1), Replicate()]),  # ndim unknown: stored as placements
])
def test_dict_and_json_round_trip(tl):
    assert TensorLayout.from_dict(tl.to_dict()) == tl
    text = tl.to_json()
    assert TensorLayout.from_json(text) == tl
    assert json.loads(text)["mesh_shape"] == list(tl.layout.mesh_shape)
    assert Layout.from_json(tl.layout.to_json()) == tl.layout


def test_bad_layouts_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="'sp' is not one of"):
        MESH("sp", "None")
    with pytest.raises(ValueError, match=r"\['tp'\].*more than one tensor dim"):
        MESH("tp", "tp")
    with pytest.raises(ValueError, match="Partial"):
        MESH([Partial(), Replicate()])
    with pytest.raises(ValueError, match="3 placements given for a 2-d mesh"):
        MESH([Replicate()] * 3)
    with pytest.raises(ValueError, match="tensor_map entry 2"):
        TensorLayout.from_tensor_map(MESH, [2, -1])
    with pytest.raises(ValueError, match="repeats"):
        Layout((2, 2), ("a", "a"))
    with pytest.raises(ValueError, match="one name per mesh dim"):
        Layout((2, 2), ("a",))
    with pytest.raises(ValueError, match="rank_list"):
        Layout((2,), ("a",), rank_list=[0, 0])
    with pytest.raises(ValueError, match="2 dims"):
        MESH("tp", "None", "None").chunk_box(0, (4, 4))


MESHES = [(4,), (3,), (2, 2), (2, 3), (3, 2), (1, 4), (2, 2, 2)]
SHAPES = [(7, 5), (3, 9), (13, 2), (8, 8), (1, 1), (0, 4), (2, 3)]


def _all_placements(ndim_mesh: int):
    return itertools.product([Replicate(), Shard(0), Shard(1)], repeat=ndim_mesh)


def test_chunk_boxes_equal_torchs_for_every_rank_shape_and_placement():
    checked = 0
    for mesh_shape in MESHES:
        layout = Layout(mesh_shape, ("a", "b", "c")[:len(mesh_shape)])
        for placements in _all_placements(len(mesh_shape)):
            tl = layout(list(placements), ndim=2)
            for shape in SHAPES:
                boxes = tl.boxes(shape)
                for rank in layout.rank_list:
                    sizes, offsets = _compute_local_shape_and_global_offset(
                        shape, mesh_shape, list(layout.coordinate(rank)), list(placements))
                    assert boxes[rank] == Box(tuple(offsets), tuple(sizes)), (mesh_shape, placements, shape, rank)
                    checked += 1
    assert checked > 2000


def test_strided_layouts_give_torchs_boxes_and_nested_chunks_when_even():
    layout = Layout((2, 3, 2), ("a", "b", "c"))
    refused = 0
    for order in itertools.permutations(range(3)):
        names = tuple(layout.alias_name[m] for m in order)
        tl = layout(names, "None")
        assert layout(list(tl.placements), ndim=2) == tl
        for shape in [(24, 3), (25, 3), (7, 1), (30, 2)]:
            torch_boxes = []
            for rank in layout.rank_list:
                sizes, offsets = _compute_local_shape_and_global_offset(
                    shape, layout.mesh_shape, list(layout.coordinate(rank)), list(tl.placements))
                torch_boxes.append(Box(tuple(offsets), tuple(sizes)))
            distinct = [b for b in set(torch_boxes) if b.numel]
            tiles = sum(b.numel for b in distinct) == shape[0] * shape[1] and not uncovered(Box.full(shape), distinct)
            if not tiles:  # torch's shards are not boxes here
                with pytest.raises(ValueError, match="not contiguous"):
                    tl.boxes(shape)
                refused += 1
                continue
            assert tl.boxes(shape) == torch_boxes, (names, shape)
            if shape[0] % 12 == 0:  # even: the outermost-first nested split
                for rank, box in enumerate(torch_boxes):
                    start, size = 0, shape[0]
                    for m in order:
                        size //= layout.mesh_shape[m]
                        start += layout.coordinate(rank)[m] * size
                    assert box == Box((start, 0), (size, shape[1])), (names, rank)
    assert 0 < refused < 24


def test_strided_shards_that_are_not_boxes_are_refused():
    """torch splits some uneven strided shards into non-contiguous rows: no box can describe them."""
    tl = Layout((3, 2), ("dp", "tp"))(("tp", "dp"))
    assert tl.chunk_box(0, (12,)) == Box((0,), (2,))
    with pytest.raises(ValueError, match="not contiguous"):
        tl.boxes((13,))


CASES = [
    ((8,), ("tp",), [Shard(0)], (13, 6)),
    ((8,), ("tp",), [Shard(1)], (6, 13)),
    ((2, 4), ("dp", "tp"), [Shard(0), Shard(0)], (13, 7)),
    ((2, 4), ("dp", "tp"), [Shard(1), Shard(0)], (5, 3)),
    ((2, 4), ("dp", "tp"), [Replicate(), Shard(1)], (3, 10)),
    ((2, 2, 2), ("pp", "dp", "tp"), [Shard(0), Replicate(), Shard(1)], (5, 9)),
]


def test_chunk_boxes_equal_the_local_shards_of_dtensors_on_each_rank():
    """Under the fake process group each rank's DTensor reports its shard; the layout agrees."""
    for mesh_shape, names, placements, shape in CASES:
        world = 1
        for s in mesh_shape:
            world *= s
        layout = Layout(mesh_shape, names)
        tl = layout(placements, ndim=len(shape))
        for rank in range(world):
            with fake_rank(rank, world):
                mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
                sizes, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
                dt = DTensor.from_local(torch.zeros(sizes), mesh, placements, shape=torch.Size(shape),
                                        stride=torch.empty(shape).stride(), run_check=False)
                chunk = dt.__create_chunk_list__()[0]
                assert TensorLayout.from_dtensor(dt) == tl
                assert TensorLayout.from_record(layout_record(dt), ndim=len(shape)) == tl
                assert Layout.from_device_mesh(mesh) == layout
            expected = Box(tuple(chunk.offsets), tuple(chunk.sizes))
            assert tl.chunk_box(rank, shape) == expected, (mesh_shape, placements, shape, rank)
            assert Box(tuple(offsets), tuple(sizes)) == expected


def test_layout_records_of_checkpoint_metadata_convert():
    rec = {"mesh_shape": [2, 4], "mesh_dim_names": ["dp", "tp"], "placements": ["_S(0,4)", "S(0)"]}
    tl = TensorLayout.from_record(rec, ndim=2)
    assert tl == MESH(("tp", "dp"), "None")
    assert tl.to_record() == rec
    unnamed = TensorLayout.from_record({"mesh_shape": [4], "mesh_dim_names": None, "placements": ["S(1)"]},
                                       ndim=2, names=("tp",))
    assert unnamed == Layout((4,), ("tp",))("None", "tp")
    with pytest.raises(ValueError, match="Partial"):
        TensorLayout.from_record({"mesh_shape": [2], "mesh_dim_names": ["x"], "placements": ["P(sum)"]})


def test_strategy_first_match_wins_and_round_trips_through_json(tmp_path):
    tp = Layout((4,), ("tp",))
    dp_tp = Layout((2, 2), ("dp", "tp"), rank_list=[0, 2, 1, 3])
    strategy = LayoutStrategy({
        "layers.0.wq.weight": tp("None", "tp"),     # exact name, listed first: wins over the glob
        "*.wq.weight": tp("tp", "None"),
        "*.norm.weight": tp("None"),
        "*.w2.weight": dp_tp("None", ("dp", "tp")),
        "emb": tp([Shard(0)]),                      # no ndim: kept as placements
    })
    assert strategy.match("layers.0.wq.weight") == tp("None", "tp")
    assert strategy.match("layers.1.wq.weight") == tp("tp", "None")
    assert strategy.match("layers.1.wk.weight") is None
    path = tmp_path / "strategy.json"
    save_layout(strategy, path)
    back = load_layout(path)
    assert list(back) == list(strategy) and back == strategy
    assert back.match("layers.0.wq.weight") == tp("None", "tp")
    doc = json.loads(path.read_text())
    assert doc["format"] == "hyper-parallel-layout" and len(doc["meshes"]) == 2
    buf = io.StringIO()
    save_layout(strategy, buf)
    assert load_layout(io.StringIO(buf.getvalue())) == strategy
    (tmp_path / "bad.json").write_text('{"format": "hyper-parallel-layout", "version": 1, "meshes": [], '
                                       '"layouts": [{"name": "x", "mesh": 3, "tensor_map": [0]}]}')
    with pytest.raises(ValueError, match=r"bad\.json.*rule 0"):
        load_layout(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="version 9"):
        load_layout(io.StringIO('{"format": "hyper-parallel-layout", "version": 9}'))


def test_get_current_layout_captures_every_dtensor_by_checkpoint_key():
    with fake_rank(1, 4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        w = DTensor.from_local(torch.zeros(2, 3), mesh, [Replicate(), Shard(0)], shape=torch.Size((4, 3)),
                               stride=(3, 1), run_check=False)
        b = DTensor.from_local(torch.zeros(3), mesh, [Replicate(), Replicate()], run_check=False)
        sd = {"model": {"w": w, "b": b, "plain": torch.zeros(2)}, "step": 3}
        strategy = get_current_layout(sd)
        module = torch.nn.Linear(3, 4)
        module.weight = torch.nn.Parameter(w)
        from_module = get_current_layout(module)
    mesh_layout = Layout((2, 2), ("dp", "tp"))
    assert strategy == {"model.w": mesh_layout("tp", "None"), "model.b": mesh_layout("None")}
    assert list(from_module) == ["weight"] and from_module["weight"] == mesh_layout("tp", "None")

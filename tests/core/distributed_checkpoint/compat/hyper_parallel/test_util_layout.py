"""HyperParallel's older ``util`` path (its path checks, and the load broadcasts made through the
platform object on 2 gloo ranks) and its ``layout`` calls (a cell's rank layout record, plain
layout maps as JSON), beside ours on the same paths."""

from __future__ import annotations

import json
import os
import tempfile
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
from multiprocess import run_ranks

from hyper_parallel.core.distributed_checkpoint import layout, util
from hyper_parallel.core.distributed_checkpoint.layout import Layout, LayoutStrategy, load_layout, save_layout
from hyper_parallel.core.distributed_checkpoint.metadata import MetadataIndex
from hyper_parallel.core.distributed_checkpoint.planner import BroadcastSource, LoadItemType, ReadItem
from hyper_parallel.core.dtensor import device_mesh


def test_a_single_file_name_needs_a_stem_and_a_suffix_with_letters():
    assert util.has_valid_filename(Path("model.safetensors")) and util.has_valid_filename("w_1.ckpt2")
    assert not util.has_valid_filename(Path(".safetensors")) and not util.has_valid_filename(Path("123.456"))
    assert not util.has_valid_filename(Path("model"))


def test_check_path_makes_the_directories_a_file_or_directory_needs():
    with tempfile.TemporaryDirectory() as d:
        util.check_path(Path(d, "a", "b", "model.safetensors"))
        util.check_path(os.path.join(d, "plain_dir"))
        assert Path(d, "a", "b").is_dir() and not Path(d, "a", "b", "model.safetensors").exists()
        assert Path(d, "plain_dir").is_dir()


def _read(fqn: str, src: int) -> ReadItem:
    index = MetadataIndex(fqn, (0,), 0)
    return ReadItem(type=LoadItemType.TENSOR, dest_index=index, dest_offsets=(0,), storage_index=index,
                    storage_offsets=(0,), lengths=(4,), source=BroadcastSource(group_ranks=(0, 1), src_rank=src))


def _broadcast_through_the_platform(rank: int, world: int) -> dict[str, Any]:
    state = {name: torch.full((4,), float(10 * n + 1)) if rank == n % 2 else torch.zeros(4)
             for n, name in enumerate(("a", "b", "c"))}  # each rank holds the shards it is the source of
    items = [_read(name, n % 2) for n, name in enumerate(("a", "b", "c"))]
    in_flight: deque = deque()
    with util.broadcast_groups_for_load(items) as groups:
        util.broadcast_shard(in_flight, state, items[0], groups)
        batcher = util.BroadcastBatcher(1 << 20, groups)
        for item in items[1:]:
            batcher.add(in_flight, state, item)
        batcher.flush(in_flight)
        util.wait_broadcasts(in_flight)
        world_group = groups[(0, 1)] is util.platform.get_world_group()
    return {"values": {k: v.tolist() for k, v in state.items()}, "reused_world": world_group}


def test_the_load_broadcasts_run_through_the_platform_on_two_ranks():
    out = run_ranks(_broadcast_through_the_platform, 2)
    for rank in (0, 1):
        assert out[rank]["values"] == {"a": [1.0] * 4, "b": [11.0] * 4, "c": [21.0] * 4}
        assert out[rank]["reused_world"]  # every rank holds it: the job's own group, nothing created


def test_utils_broadcasts_read_the_platform_at_call_time():
    class Refusing:
        def __getattr__(self, name: str) -> Any:
            raise RuntimeError(f"asked for {name}")

    with mock.patch.object(util, "platform", Refusing()), pytest.raises(RuntimeError, match="asked for"):
        util.ensure_broadcast_groups([_read("a", 0)])


def test_a_mesh_without_a_process_group_takes_its_rank_from_the_platform():
    device_mesh._DEVICE_MESH_MAP.clear()
    with mock.patch.object(device_mesh.platform, "get_rank", return_value=1):
        mesh = device_mesh._create_device_mesh("cpu", (2,), mesh_dim_names=("dp",), init_backend=False)
    assert list(mesh.get_coordinate()) == [1]
    device_mesh._DEVICE_MESH_MAP.clear()


class _Cell:
    """A model in HyperParallel's sense: named parameters carrying a ``layout``."""

    def __init__(self, params: dict[str, Any]):
        self.params = params

    def named_parameters(self):
        return iter(self.params.items())


def test_a_cells_layout_record_is_keyed_by_rank_and_notes_parameters_without_a_layout():
    tp = Layout((2, 2), ("dp", "tp"))
    weight = SimpleNamespace(layout=tp("tp", "None"), dtype=torch.float32, shape=(4, 8))
    cell = _Cell({"w": weight, "plain": SimpleNamespace(dtype=torch.float32, shape=(3,)),
                  "empty": SimpleNamespace(layout=None, dtype=torch.int64, shape=())})
    with mock.patch.object(layout.logger, "info") as info:
        record = layout.get_current_layout(cell)
    assert list(record) == ["0"]  # no process group: rank 0
    w = record["0"]["w"]
    assert w["type"] == "torch.float32" and w["full_shape"] == (4, 8) and "mesh_shape" not in w
    assert record["0"]["plain"] is None and record["0"]["empty"] is None
    info.assert_called_once()
    assert info.call_args[0][1] == ["plain"]


def test_our_get_current_layout_still_answers_for_state_dicts_and_modules():
    assert layout.get_current_layout({"w": torch.zeros(2)}) == LayoutStrategy()
    assert isinstance(layout.get_current_layout(torch.nn.Linear(2, 2)), LayoutStrategy)


def test_a_plain_layout_map_is_written_and_read_back_as_the_json_it_is():
    record = {"0": {"w": {"device_matrix": [2, 2], "tensor_map": [1, -1]}, "b": None}}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d, "new", "rank0.layout")
        save_layout(record, path)
        assert json.loads(path.read_text()) == record
        assert load_layout(path) == record
        ours = {"*.weight": Layout((2,), ("tp",))("tp", "None")}
        save_layout(ours, Path(d, "ours.json"))
        assert isinstance(load_layout(Path(d, "ours.json")), LayoutStrategy)
        with pytest.raises(TypeError, match="'b'"):
            save_layout({**ours, "b": {"tensor_map": [0]}}, Path(d, "mixed.json"))
        Path(d, "foreign.json").write_text('{"format": "something-else"}')
        with pytest.raises(ValueError, match="something-else"):
            load_layout(Path(d, "foreign.json"))
        with pytest.raises(FileNotFoundError, match="missing.layout"):
            load_layout(Path(d, "missing.layout"))


def test_combine_layout_merges_every_layout_file_of_a_directory(tmp_path):
    save_layout({"0": {"w": {"tensor_map": [0, -1]}}}, tmp_path / "rank0.layout")
    save_layout({"1": {"w": {"tensor_map": [0, -1]}}, "2": {"w": None}}, tmp_path / "rank1.layout")
    save_layout({"9": {}}, tmp_path / "other.json")  # not a .layout file: left out
    assert layout.combine_layout(tmp_path) == {"0": {"w": {"tensor_map": [0, -1]}},
                                               "1": {"w": {"tensor_map": [0, -1]}}, "2": {"w": None}}
    save_layout({"1": {}}, tmp_path / "again.layout")
    with pytest.raises(ValueError, match=r"rank 1 has a layout in both .*again\.layout and .*rank1\.layout"):
        layout.combine_layout(tmp_path)


def test_combine_layout_refuses_a_layout_file_that_is_not_a_layout_map(tmp_path):
    save_layout({"*.weight": Layout((2,), ("tp",))("tp", "None")}, tmp_path / "ours.layout")
    with pytest.raises(ValueError, match=r"ours\.layout: a layout map"):
        layout.combine_layout(tmp_path)


def _global_layout(rank: int, world_size: int) -> dict:
    tp = Layout((2,), ("tp",))
    weight = SimpleNamespace(layout=tp("tp", "None"), dtype=torch.float32, shape=(4, 2 + rank))
    return layout.get_global_layout(_Cell({"w": weight}))


def test_get_global_layout_gathers_every_ranks_record_on_every_rank():
    results = run_ranks(_global_layout, 2)
    assert results[0] == results[1]
    assert sorted(results[0]) == ["0", "1"]
    assert results[0]["0"]["w"]["full_shape"] == (4, 2) and results[0]["1"]["w"]["full_shape"] == (4, 3)

"""HyperParallel's storage calls on our filesystem writer and reader (interop/seed_storage.py):
its per-rank files written and read back, physical keys, byte values, the pickled metadata read
with an allow-list, bad file names, the open-file cache and the face's patch points."""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hyper_parallel.core.distributed_checkpoint import StandardPlanner, filesystem_storage
from hyper_parallel.core.distributed_checkpoint._src.base.errors import MetadataError, UnsupportedValueError
from hyper_parallel.core.distributed_checkpoint._src.interop.hyper_parallel.storage_calls import OpenFiles
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata, MetadataIndex
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, ReadItem
from hyper_parallel.core.distributed_checkpoint.storage import StorageInfo


def _save(directory: str, state: dict, rank: int = 0, use_collectives: bool = True,
          planner: StandardPlanner | None = None) -> Metadata:
    planner = planner or StandardPlanner()
    planner.configure_planner(state, rank=rank, use_collectives=use_collectives)
    plan, metadata = planner.build_global_plan([planner.build_local_plan()])
    writer = filesystem_storage.FileSystemWriter(directory)
    writer.configure_writer(is_coordinator=True, rank=rank, use_collectives=use_collectives)
    writer.finalize_checkpoint(metadata, [writer.execute_write(planner.finalize_plan(plan), planner)])
    return metadata


def _load(directory: str, target: dict, rank: int | None = None, planner: StandardPlanner | None = None) -> None:
    reader = filesystem_storage.FileSystemReader(directory)
    metadata = reader.load_metadata() if rank is None else reader.load_metadata(rank=rank)
    planner = planner or StandardPlanner()
    planner.configure_planner(target, metadata, rank=rank or 0)
    reader.configure_reader(metadata, is_coordinator=True, rank=rank or 0)
    reader.execute_read(planner.build_local_plan(), planner)


def test_tensors_and_values_round_trip_through_hyperparallels_files():
    with tempfile.TemporaryDirectory() as d:
        state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor(2.5)}, "step": 9, "raw": b"\x00\x01"}
        _save(d, state)
        assert sorted(os.listdir(d)) == [".metadata", "_rank0_.bytes", "_rank0_.safetensors"]
        with safe_open(os.path.join(d, "_rank0_.safetensors"), framework="pt") as f:
            assert set(f.keys()) == {"model.w", "model.b"}  # any safetensors tool opens it
        target = {"model": {"w": torch.zeros(2, 3), "b": torch.tensor(0.0)}, "step": 0, "raw": b""}
        _load(d, target)
        assert torch.equal(target["model"]["w"], state["model"]["w"])
        assert target["model"]["b"].item() == 2.5 and target["step"] == 9 and target["raw"] == b"\x00\x01"


def test_without_collectives_each_rank_commits_its_own_metadata():
    with tempfile.TemporaryDirectory() as d:
        _save(d, {"w": torch.ones(3)}, rank=1, use_collectives=False)
        assert sorted(os.listdir(d)) == ["1.metadata", "_rank1_.safetensors"]
        reader = filesystem_storage.FileSystemReader(d)
        with pytest.raises(FileNotFoundError, match=r"\.metadata"):
            reader.load_metadata()
        target = {"w": torch.zeros(3)}
        _load(d, target, rank=1)
        assert torch.equal(target["w"], torch.ones(3))


def test_several_chunks_of_one_tensor_get_their_own_keys_in_the_file():
    from hyper_parallel.core.distributed_checkpoint.metadata import ChunkStorageMetadata
    from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, WriteItem, WriteItemType

    class Data:  # a planner reduced to the one call a writer makes
        def get_data(self, item):
            return torch.full((1, 2), float(item.index.offset[0]))

    items = [WriteItem(index=MetadataIndex("w", (row, 0)), type=WriteItemType.TENSOR,
                       tensor_data={"chunk": ChunkStorageMetadata(torch.Size((row, 0)), torch.Size((1, 2)))})
             for row in (0, 1)]
    with tempfile.TemporaryDirectory() as d:
        writer = filesystem_storage.FileSystemWriter(d)
        writer.configure_writer(is_coordinator=True, rank=0)
        results = writer.execute_write(SavePlan(items=items), Data())
        keys = [r.storage_data.tensor_key for r in results]
        assert keys == ["w.__dcp_chunk_0", "w.__dcp_chunk_1"]
        with safe_open(os.path.join(d, "_rank0_.safetensors"), framework="pt") as f:
            assert f.get_tensor("w.__dcp_chunk_1").tolist() == [[1.0, 1.0]]


class _Opaque:
    pass


def test_a_value_that_needs_code_to_rebuild_is_refused_unless_the_planner_allows_pickle():
    with tempfile.TemporaryDirectory() as d:
        with pytest.raises(UnsupportedValueError, match="'obj'"):
            _save(d, {"obj": _Opaque()})
        _save(d, {"obj": _Opaque()}, planner=StandardPlanner(allow_pickle=True))
        target = {"obj": None}
        with pytest.raises(UnsupportedValueError, match="'obj'"):
            _load(d, target)  # a planner without allow_pickle refuses it on load too
        _load(d, target, planner=StandardPlanner(allow_pickle=True))
        assert isinstance(target["obj"], _Opaque)


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_metadata_naming_anything_but_records_is_refused_before_anything_runs():
    with tempfile.TemporaryDirectory() as d:
        Path(d, ".metadata").write_bytes(pickle.dumps(_Boom()))
        with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
            filesystem_storage.FileSystemReader(d).load_metadata()
        Path(d, ".metadata").write_text('{"format": "hyper-parallel"}')
        with pytest.raises(ValueError, match="not HyperParallel's pickled metadata"):
            filesystem_storage.FileSystemReader(d).load_metadata()


def test_a_file_name_outside_the_directory_is_refused():
    index = MetadataIndex("w", (0,), 0)
    reader = filesystem_storage.FileSystemReader("/tmp/unused")
    reader.storage_data = {index: StorageInfo(relative_path="../../etc/passwd", offset=0, length=4)}
    item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=(0,), storage_index=index,
                    storage_offsets=(0,), lengths=(0,))
    with pytest.raises(MetadataError, match="passwd"):
        reader._group_items_by_file([item])


def test_the_open_file_cache_holds_the_most_recent_files_and_closes_the_rest():
    opened, closed = [], []
    files = OpenFiles(2, lambda path: opened.append(path) or path.upper(), closed.append)
    assert [files.reader(p) for p in ("a", "b", "a", "c", "a")] == ["A", "B", "A", "C", "A"]
    assert opened == ["a", "b", "c"] and closed == ["B"]  # b was the least recently used
    files.close()
    assert sorted(closed) == ["A", "B", "C"]


def test_the_reader_opens_files_through_the_faces_safe_open():
    with tempfile.TemporaryDirectory() as d:
        _save(d, {"w": torch.ones(2)})
        seen = []
        original = filesystem_storage.safe_open

        def counting(path, **kwargs):
            seen.append(os.path.basename(path))
            return original(path, **kwargs)

        filesystem_storage.safe_open = counting
        try:
            target = {"w": torch.zeros(2)}
            _load(d, target)
        finally:
            filesystem_storage.safe_open = original
        assert seen == ["_rank0_.safetensors"] and torch.equal(target["w"], torch.ones(2))


def test_a_writer_and_reader_of_ours_still_save_and_load_our_format():
    from hyper_parallel.core.distributed_checkpoint import load, save

    with tempfile.TemporaryDirectory() as d:
        save({"w": torch.ones(3)}, storage_writer=filesystem_storage.FileSystemWriter(d), no_dist=True)
        assert Path(d, ".metadata").read_bytes().startswith(b"{")  # our JSON document
        out = load({"w": torch.zeros(3)}, storage_reader=filesystem_storage.FileSystemReader(d), no_dist=True)
        assert torch.equal(out["w"], torch.ones(3))


FORM_R3 = Path(__file__).resolve().parents[4] / "fixtures" / "hyper_parallel_form_r3"


def test_a_checkpoint_the_previous_release_wrote_still_loads():
    # its pickle names the record classes where release 3 kept them (format.records, ...)
    raw = (FORM_R3 / ".metadata").read_bytes()
    assert b"hyper_parallel.core.distributed_checkpoint.format.records" in raw
    target = {"model": {"w": torch.zeros(2, 3)}, "step": 0, "raw": b""}
    _load(str(FORM_R3), target)
    assert torch.equal(target["model"]["w"], torch.arange(6.0).reshape(2, 3))
    assert target["step"] == 9 and target["raw"] == b"\x00\x01"


def test_new_metadata_names_the_public_paths_of_its_records(tmp_path):
    # so a file written now loads after the internals move again
    _save(str(tmp_path), {"w": torch.ones(2), "step": 1})
    raw = (tmp_path / ".metadata").read_bytes()
    assert b"_src" not in raw
    assert b"hyper_parallel.core.distributed_checkpoint.metadata" in raw
    assert b"hyper_parallel.core.distributed_checkpoint.storage" in raw

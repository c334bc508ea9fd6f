"""The package as layers: imports point down, the picture is current, public paths never move.

The rules live in ``scripts/import_graph.py`` (its ``LAYERS``); these tests hold every change
to them, and to the public import paths that code written for this library, for torch DCP
and for HyperParallel uses.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
import_graph = importlib.util.module_from_spec(spec)
spec.loader.exec_module(import_graph)

PKG = "hyper_parallel.core.distributed_checkpoint"

# Every name the package exported before it became layers (release 2), and since.
PUBLIC = [
    "offline_transform", "save_state_dict_as_huggingface_format", "parse_checkpoint_from_huggingface",
    "full_state_dict_to_dcp_format", "dcp_to_full_state_dict", "convert_full_checkpoint_to_dcp", "import_torch_dcp",
    "import_hyper_parallel", "save_checkpoint", "load_checkpoint", "export_torch_dcp", "import_mindspore",
    "export_mindspore", "read_mindspore_checkpoint", "verify_checkpoint", "FsspecWriter", "FsspecReader", "save",
    "load", "async_save", "CheckpointManager", "StepInfo", "SaveTiming", "list_steps", "AsyncSaveResponse",
    "AsyncSaveFuture", "AsyncCheckpointer", "AsyncSaveError", "AsyncStagingError", "StagingStats",
    "default_checkpointer", "register_optimizer_hook", "StandardPlanner", "StandardSavePlanner", "StandardLoadPlanner",
    "SavePlanner", "LoadPlanner", "SavePlan", "LoadPlan", "WriteItem", "ReadItem", "StorageWriter", "StorageReader",
    "TopologyMapper", "FileSystemWriter", "FileSystemReader", "HuggingFaceStorageReader",
    "TorchShardedSafetensorsReader", "Metadata", "Layout", "TensorLayout", "LayoutStrategy", "save_layout",
    "load_layout", "get_current_layout", "CheckpointError", "CommitError", "LostContactError", "StorageTimeoutError",
    "CorruptCheckpointError", "MetadataError", "NotACheckpointError", "RankFailedError", "StateDictMismatchError",
    "UnsupportedValueError", "TrainState", "get_train_state_dict", "set_train_state_dict", "rng_state_dict",
    "load_rng_state_dict",
]

# Import paths of the seed, the docs and HyperParallel's code and tests: module -> names it must hold.
PATHS = {
    "api": ["save", "load", "dist", "mp", "_save_impl", "_create_persist_process", "execute_async_persist",
            "execute_async_persist_with_gloo"],
    "planner": ["SavePlanner", "LoadPlanner", "SavePlan", "LoadPlan", "WriteItem", "ReadItem", "EntrySpec",
                "BroadcastSource"],
    "standard_planner": ["StandardPlanner", "StandardSavePlanner", "StandardLoadPlanner", "BoxSavePlanner",
                         "BoxLoadPlanner",
                         "create_read_items_for_chunk_list", "_is_on_host"],
    "saver": ["save_checkpoint"],
    "loader": ["load_checkpoint"],
    "storage": ["StorageWriter", "StorageReader", "StorageInfo", "METADATA_FILE_NAME"],
    "filesystem_storage": ["FileSystemWriter", "FileSystemReader", "safe_open", "_get_tensor_size", "_OpenFiles",
                           "_open_checkpoint_files", "_fetch_tensor_file", "_apply_fetched", "BroadcastBatcher",
                           "wait_broadcasts"],
    "metadata": ["Metadata", "CHUNK_INFO", "ChunkInfo", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "MetadataIndex", "TensorProperties", "TensorStorageMetadata"],
    "reshard": ["reshard", "ReshardHandler", "check_layout", "infer_intersection", "infer_slice_area_by_rank",
                "rank_id_to_dev_id_list"],
    "async_staging": ["async_save", "AsyncCheckpointer", "AsyncSaveResponse", "AsyncSaveFuture",
                      "build_staged_state_dict"],
    "offline_transform": ["offline_transform", "convert_full_checkpoint_to_dcp", "import_torch_dcp"],
    "layout": ["Layout", "TensorLayout", "LayoutStrategy", "save_layout", "load_layout", "get_current_layout",
               "platform", "logger"],
    "util": ["_MAX_BROADCASTS_IN_FLIGHT", "platform", "check_path", "has_valid_filename", "chunk_to_area",
             "flatten_state_dict", "narrow_tensor_by_index", "plan_ownership_masks", "set_element",
             "traverse_state_dict", "create_chunk_list_for_tensor", "broadcast_shard", "wait_broadcasts",
             "ensure_broadcast_groups", "broadcast_groups_for_load", "BroadcastBatcher"],
    # torch.distributed.checkpoint's module paths (test_torch_names.py checks every name of each)
    "staging": ["AsyncStager", "DefaultStager", "StagingOptions"],
    "stateful": ["Stateful"],
    "state_dict_saver": ["save", "async_save", "save_state_dict", "_save_state_dict", "AsyncSaveResponse"],
    "state_dict_loader": ["load", "load_state_dict", "_load_state_dict"],
    "filesystem": ["FileSystemWriter", "FileSystemReader"],
    "format_utils": ["dcp_to_torch_save", "torch_save_to_dcp", "_load_state_dict", "_EmptyStateDictLoadPlanner"],
    "_consolidate_hf_safetensors": ["consolidate_safetensors_files", "consolidate_safetensors_files_on_every_rank"],
    "utils": ["find_tensor_shard", "find_state_dict_object", "all_gather_object", "chunk_to_area",
              "create_chunk_list_for_tensor", "flatten_state_dict", "infer_intersection", "narrow_tensor_by_index",
              "plan_ownership_masks", "set_element", "traverse_state_dict", "dist"],
    "planner_helpers": ["create_read_items_for_chunk_list"],
    "optimizer": ["load_sharded_optimizer_state_dict"],
    "state_dict": ["get_state_dict", "set_state_dict", "StateDictOptions"],
    "logger": ["DCP_LOGGER_NAME"],
    "logging_handlers": ["DCP_LOGGER_NAME"],
    "hf_storage": ["HuggingFaceStorageReader", "DCP_SHARDING_INFO_KEY", "SAFETENSORS_INDEX_SUFFIX",
                   "SAVED_OFFSETS_KEY"],
    # HyperParallel's newer paths (issue 43)
    "versioning": ["CURRENT_CHECKPOINT_VERSION", "migrate_metadata", "_MIGRATION_RULES"],
    "topology_mapper": ["TopologyMapper"],
    "checkpoint_io": ["save_checkpoint_file", "load_checkpoint_file"],
    "ragged_utils": ["_decompose_flat_interval", "compute_ragged_boxes", "create_ragged_write_items",
                     "get_ragged_box_tensor"],
    "broadcast": ["BroadcastSource", "broadcast_shard", "wait_broadcasts", "broadcast_groups_for_load",
                  "BroadcastBatcher", "read_and_broadcast", "_MAX_BROADCASTS_IN_FLIGHT",
                  "DEFAULT_BROADCAST_BATCH_BYTES"],
    "ragged": ["_decompose_flat_interval", "compute_ragged_boxes", "create_ragged_write_items",
               "get_ragged_box_tensor"],
    "remap_planner": ["RemapLoadPlanner", "RemapBlock", "DeferredRead", "_DEFERRED_FQN_PREFIX"],
    "async_persist": ["build_staged_state_dict", "DataCopier", "AsyncPersistStatus", "AsyncSaveResponse", "FileType",
                      "write_file", "load_file", "batch_read_worker", "construct_file_batches",
                      "resolve_async_persist_result", "execute_async_persist", "execute_async_persist_with_gloo",
                      "_COMPLETE_FLAG", "StandardSavePlanner"],
}


def test_imports_point_down_with_no_circles():
    assert import_graph.violations() == []


def test_the_committed_picture_of_the_layers_is_current():
    assert (ROOT / "docs" / "layers.md").read_text() == import_graph.picture(), (
        "docs/layers.md is stale: run python scripts/import_graph.py --write")


def test_the_checker_sees_a_circle_and_an_import_running_back_up():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert import_graph.cycles(graph) == [["a", "b", "c"]]
    mods = import_graph.modules()
    graph = import_graph.imports(mods)
    assert "_src.base.errors" in graph["_src.format.metadata"]  # the walker resolves relative imports
    assert not graph["_src.base.errors"]


def test_every_public_name_is_importable_from_the_package():
    pkg = importlib.import_module(PKG)
    assert [n for n in PUBLIC if getattr(pkg, n, None) is None] == []
    for name in pkg.__all__:
        assert getattr(pkg, name) is not None, name


# torch.distributed.checkpoint's package names (torch 2.13's __init__) and HyperParallel's (its
# newest __all__): __all__ is these plus our own few headline names, nothing else.
TORCH_PACKAGE = {
    "save", "load", "async_save", "save_state_dict", "load_state_dict", "load_sharded_optimizer_state_dict",
    "CheckpointException", "DefaultSavePlanner", "DefaultLoadPlanner", "SavePlanner", "LoadPlanner", "SavePlan",
    "LoadPlan", "WriteItem", "ReadItem", "StorageWriter", "StorageReader", "FileSystemWriter", "FileSystemReader",
    "HuggingFaceStorageReader", "HuggingFaceStorageWriter", "QuantizedHuggingFaceStorageReader", "Metadata",
    "BytesStorageMetadata", "ChunkStorageMetadata", "TensorStorageMetadata",
}
HYPER_PARALLEL_PACKAGE = {
    "save", "async_save", "AsyncSaveResponse", "load", "Metadata", "MetadataIndex", "TensorStorageMetadata",
    "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "CHUNK_INFO", "ChunkInfo", "SavePlanner",
    "LoadPlanner", "SavePlan", "LoadPlan", "WriteItem", "ReadItem", "WriteItemType", "LoadItemType",
    "StandardSavePlanner", "StandardLoadPlanner", "StorageWriter", "StorageReader", "StorageInfo", "WriteResult",
    "FileSystemWriter", "FileSystemReader", "get_current_layout", "save_layout", "load_layout", "combine_layout",
    "get_global_layout", "save_checkpoint", "load_checkpoint", "ReshardHandler",
}
OWN_HEADLINES = {"StandardPlanner", "offline_transform", "CheckpointManager", "TrainState", "AsyncCheckpointer",
                 "verify_checkpoint", "CheckpointError"}


def test_all_is_torch_s_and_hyper_parallel_s_names_and_a_few_of_ours():
    pkg = importlib.import_module(PKG)
    assert len(pkg.__all__) == len(set(pkg.__all__))
    assert set(pkg.__all__) == TORCH_PACKAGE | HYPER_PARALLEL_PACKAGE | OWN_HEADLINES
    import torch.distributed.checkpoint as torch_dcp  # torch's names are really torch's package names
    assert [n for n in TORCH_PACKAGE if not hasattr(torch_dcp, n)] == []


def test_the_top_folder_holds_only_public_faces_and_the_private_internals():
    top = ROOT / "hyper_parallel" / "core" / "distributed_checkpoint"
    folders = sorted(p.name for p in top.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == ["_src"]
    assert (top / "_src" / "README.md").is_file()


@pytest.mark.parametrize("module", sorted(PATHS))
def test_every_compatibility_path_holds_its_names(module):
    mod = importlib.import_module(f"{PKG}.{module}")
    assert [n for n in PATHS[module] if not hasattr(mod, n)] == []


def test_a_face_module_does_not_shadow_the_function_of_its_name():
    # importing the face module offline_transform must leave the package's offline_transform a function
    importlib.import_module(f"{PKG}.offline_transform")
    pkg = importlib.import_module(PKG)
    assert callable(pkg.offline_transform) and not isinstance(pkg.offline_transform, type(pkg))


def test_every_room_of_the_internals_has_its_test_folder():
    # the tests mirror the package: _src/<room>/ (and interop's ecosystems) <-> tests/.../<room>/
    src = ROOT / "hyper_parallel" / "core" / "distributed_checkpoint" / "_src"
    here = Path(__file__).resolve().parent
    rooms = sorted(p.parent.relative_to(src) for p in src.rglob("__init__.py") if p.parent != src)
    bare = [str(r) for r in rooms if not any((here / r).glob("test_*.py"))
            and not any(p.is_dir() and any(p.glob("test_*.py")) for p in (here / r).glob("*"))]
    assert bare == [], f"rooms of _src with no test folder under {here}: {bare}"
    assert sorted(p.name for p in here.glob("test_*.py")) == ["test_layers.py"], "tests sit in their room's folder"

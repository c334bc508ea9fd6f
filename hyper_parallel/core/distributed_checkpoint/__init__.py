"""DCP: distributed checkpoint for sharded PyTorch state dicts.

Every rank saves only its local shards; a checkpoint saved under one parallel layout loads
under any other. See ``docs/design.md`` for the architecture and ``docs/format.md`` for the
on-disk format.
"""

from .api import load, save
from .async_staging import (
    AsyncCheckpointer,
    AsyncSaveError,
    AsyncSaveResponse,
    AsyncStagingError,
    StagingStats,
    async_save,
    default_checkpointer,
    register_optimizer_hook,
)
from .errors import (
    CheckpointError,
    CommitError,
    CorruptCheckpointError,
    LostContactError,
    MetadataError,
    NotACheckpointError,
    RankFailedError,
    StateDictMismatchError,
    StorageTimeoutError,
    UnsupportedValueError,
)
from .filesystem_storage import FileSystemReader, FileSystemWriter
from .fsspec_storage import FsspecReader, FsspecWriter
from .hf_storage import HuggingFaceStorageReader, TorchShardedSafetensorsReader
from .hyper_parallel_import import import_hyper_parallel
from .layout import Layout, LayoutStrategy, TensorLayout, get_current_layout, load_layout, save_layout
from .manager import CheckpointManager, SaveTiming
from .metadata import Metadata
from .mindspore_format import export_mindspore, import_mindspore, read_mindspore_checkpoint
from .offline_transform import (
    convert_full_checkpoint_to_dcp,
    dcp_to_full_state_dict,
    full_state_dict_to_dcp_format,
    import_torch_dcp,
    offline_transform,
    parse_checkpoint_from_huggingface,
    save_state_dict_as_huggingface_format,
)
from .planner import LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItem
from .single_file import load_checkpoint, save_checkpoint
from .standard_planner import StandardLoadPlanner, StandardPlanner, StandardSavePlanner
from .state_dict import TrainState, get_train_state_dict, load_rng_state_dict, rng_state_dict, set_train_state_dict
from .step_directory import StepInfo, list_steps
from .storage import StorageReader, StorageWriter
from .topology_mapper import TopologyMapper
from .torch_dcp_export import export_torch_dcp
from .verify import verify_checkpoint

__all__ = [
    "offline_transform",
    "save_state_dict_as_huggingface_format",
    "parse_checkpoint_from_huggingface",
    "full_state_dict_to_dcp_format",
    "dcp_to_full_state_dict",
    "convert_full_checkpoint_to_dcp",
    "import_torch_dcp",
    "import_hyper_parallel",
    "save_checkpoint",
    "load_checkpoint",
    "export_torch_dcp",
    "import_mindspore",
    "export_mindspore",
    "read_mindspore_checkpoint",
    "verify_checkpoint",
    "FsspecWriter",
    "FsspecReader",
    "save",
    "load",
    "async_save",
    "CheckpointManager",
    "StepInfo",
    "SaveTiming",
    "list_steps",
    "AsyncSaveResponse",
    "AsyncCheckpointer",
    "AsyncSaveError",
    "AsyncStagingError",
    "StagingStats",
    "default_checkpointer",
    "register_optimizer_hook",
    "StandardPlanner",
    "StandardSavePlanner",
    "StandardLoadPlanner",
    "SavePlanner",
    "LoadPlanner",
    "SavePlan",
    "LoadPlan",
    "WriteItem",
    "ReadItem",
    "StorageWriter",
    "StorageReader",
    "TopologyMapper",
    "FileSystemWriter",
    "FileSystemReader",
    "HuggingFaceStorageReader",
    "TorchShardedSafetensorsReader",
    "Metadata",
    "Layout",
    "TensorLayout",
    "LayoutStrategy",
    "save_layout",
    "load_layout",
    "get_current_layout",
    "CheckpointError",
    "CommitError",
    "LostContactError",
    "StorageTimeoutError",
    "CorruptCheckpointError",
    "MetadataError",
    "NotACheckpointError",
    "RankFailedError",
    "StateDictMismatchError",
    "UnsupportedValueError",
    "TrainState",
    "get_train_state_dict",
    "set_train_state_dict",
    "rng_state_dict",
    "load_rng_state_dict",
]

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
    CorruptCheckpointError,
    MetadataError,
    NotACheckpointError,
    RankFailedError,
    StateDictMismatchError,
    UnsupportedValueError,
)
from .filesystem_storage import FileSystemReader, FileSystemWriter
from .layout import Layout, LayoutStrategy, TensorLayout, get_current_layout, load_layout, save_layout
from .metadata import Metadata
from .planner import LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItem
from .standard_planner import StandardLoadPlanner, StandardPlanner, StandardSavePlanner
from .state_dict import TrainState, get_train_state_dict, load_rng_state_dict, rng_state_dict, set_train_state_dict
from .storage import StorageReader, StorageWriter

__all__ = [
    "save",
    "load",
    "async_save",
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
    "FileSystemWriter",
    "FileSystemReader",
    "Metadata",
    "Layout",
    "TensorLayout",
    "LayoutStrategy",
    "save_layout",
    "load_layout",
    "get_current_layout",
    "CheckpointError",
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

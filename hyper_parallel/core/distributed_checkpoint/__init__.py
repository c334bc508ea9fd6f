"""DCP: distributed checkpoint for sharded PyTorch state dicts.

Every rank saves only its local shards; a checkpoint saved under one parallel layout loads
under any other. See ``docs/design.md`` for the architecture and ``docs/format.md`` for the
on-disk format.
"""

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner  # torch's own

# torch's submodules are attributes of the package after `import torch.distributed.checkpoint as
# dcp` (code writes `dcp.staging.DefaultStager`); the faces of the same names are ours.
from . import (  # noqa: F401
    api,
    default_planner,
    filesystem,
    hf_storage,
    logger,
    logging_handlers,
    metadata,
    optimizer,
    planner,
    planner_helpers,
    quantized_hf_storage,
    staging,
    state_dict_loader,
    state_dict_saver,
    stateful,
    storage,
    utils,
)
from .asynchronous.api import async_save, default_checkpointer, register_optimizer_hook
from .asynchronous.buffers import StagingStats
from .asynchronous.checkpointer import AsyncCheckpointer
from .asynchronous.response import AsyncSaveError, AsyncSaveFuture, AsyncSaveResponse, AsyncStagingError
from .backends.filesystem import FileSystemReader, FileSystemWriter
from .backends.fsspec import FsspecReader, FsspecWriter
from .backends.torch_abcs import StorageReader, StorageWriter
from .base.errors import (
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
from .engine.checkpoint import load, save
from .format.records import BytesStorageMetadata, ChunkStorageMetadata, Metadata, TensorStorageMetadata
from .interop import torch_hf_storage as _torch_hf_storage  # noqa: F401 (registers torch's HF storage classes)
from .interop.deprecated_calls import load_state_dict, save_state_dict
from .interop.hf_writer import HuggingFaceStorageWriter
from .interop.huggingface import HuggingFaceStorageReader, TorchShardedSafetensorsReader
from .interop.hyper_parallel import import_hyper_parallel
from .interop.mindspore import export_mindspore, import_mindspore, read_mindspore_checkpoint
from .interop.quantized_hf import QuantizedHuggingFaceStorageReader
from .interop.sharded_optimizer import load_sharded_optimizer_state_dict
from .interop.single_file import load_checkpoint, save_checkpoint
from .interop.torch_dcp import export_torch_dcp
from .manager.checkpoint_manager import CheckpointManager, SaveTiming
from .manager.step_listing import StepInfo, list_steps
from .offline_transform import (
    convert_full_checkpoint_to_dcp,
    dcp_to_full_state_dict,
    full_state_dict_to_dcp_format,
    import_torch_dcp,
    offline_transform,
    parse_checkpoint_from_huggingface,
    save_state_dict_as_huggingface_format,
)
from .planning.protocols import LoadPlanner, SavePlanner
from .planning.records import LoadPlan, ReadItem, SavePlan, WriteItem
from .planning.standard_planner import StandardLoadPlanner, StandardPlanner, StandardSavePlanner
from .sharding.layout import Layout, TensorLayout
from .sharding.layout_files import load_layout, save_layout
from .sharding.strategy import LayoutStrategy, get_current_layout
from .state.topology_mapper import TopologyMapper
from .state.train_state import (
    TrainState,
    get_train_state_dict,
    load_rng_state_dict,
    rng_state_dict,
    set_train_state_dict,
)
from .tools.verify import verify_checkpoint

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
    "AsyncSaveFuture",
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
    "DefaultSavePlanner",
    "DefaultLoadPlanner",
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
    "HuggingFaceStorageWriter",
    "TorchShardedSafetensorsReader",
    "QuantizedHuggingFaceStorageReader",
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
    # torch.distributed.checkpoint's names (issue 32)
    "CheckpointException",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorStorageMetadata",
    "save_state_dict",
    "load_state_dict",
    "load_sharded_optimizer_state_dict",
]

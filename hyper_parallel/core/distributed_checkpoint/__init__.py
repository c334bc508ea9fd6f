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
    resharding,
    staging,
    state_dict_loader,
    state_dict_saver,
    stateful,
    storage,
    utils,
)
from ._src.asynchronous.api import async_save, default_checkpointer, register_optimizer_hook
from ._src.asynchronous.buffers import StagingStats
from ._src.asynchronous.checkpointer import AsyncCheckpointer
from ._src.asynchronous.response import AsyncSaveError, AsyncSaveFuture, AsyncSaveResponse, AsyncStagingError
from ._src.backends.filesystem import FileSystemReader, FileSystemWriter
from ._src.backends.fsspec import FsspecReader, FsspecWriter
from ._src.backends.torch_abcs import StorageReader, StorageWriter
from ._src.base.errors import (
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
from ._src.engine.checkpoint import load, save
from ._src.format.records import BytesStorageMetadata, ChunkStorageMetadata, Metadata, TensorStorageMetadata
from ._src.interop.huggingface import torch_storage as _torch_hf_storage  # noqa: F401 (registers torch's HF storage classes)
from ._src.interop.huggingface.quantized import QuantizedHuggingFaceStorageReader
from ._src.interop.huggingface.reader import HuggingFaceStorageReader, TorchShardedSafetensorsReader
from ._src.interop.huggingface.writer import HuggingFaceStorageWriter
from ._src.interop.hyper_parallel.importing import import_hyper_parallel
from ._src.interop.hyper_parallel.layout_files import load_layout, save_layout
from ._src.interop.hyper_parallel.single_file import load_checkpoint, save_checkpoint
from ._src.interop.mindspore.checkpoints import export_mindspore, import_mindspore, read_mindspore_checkpoint
from ._src.interop.torch.deprecated_calls import load_state_dict, save_state_dict
from ._src.interop.torch.exporting import export_torch_dcp
from ._src.interop.torch.sharded_optimizer import load_sharded_optimizer_state_dict
from ._src.manager.checkpoint_manager import CheckpointManager, SaveTiming
from ._src.manager.step_listing import StepInfo, list_steps
from ._src.planning.protocols import LoadPlanner, SavePlanner
from ._src.planning.records import LoadPlan, ReadItem, SavePlan, WriteItem
from ._src.planning.standard_planner import StandardLoadPlanner, StandardPlanner, StandardSavePlanner
from ._src.sharding.layout import Layout, TensorLayout
from ._src.sharding.strategy import LayoutStrategy, get_current_layout
from ._src.state.topology_mapper import TopologyMapper
from ._src.state.train_state import (
    TrainState,
    get_train_state_dict,
    load_rng_state_dict,
    rng_state_dict,
    set_train_state_dict,
)
from ._src.tools.verify import verify_checkpoint

# HyperParallel's package names that live in its faces (its newer DCP exports them here too).
from .layout import combine_layout, get_global_layout
from .metadata import CHUNK_INFO, ChunkInfo, MetadataIndex, TensorProperties
from .offline_transform import (
    convert_full_checkpoint_to_dcp,
    dcp_to_full_state_dict,
    full_state_dict_to_dcp_format,
    import_torch_dcp,
    offline_transform,
    parse_checkpoint_from_huggingface,
    save_state_dict_as_huggingface_format,
)
from .planner import LoadItemType, WriteItemType
from .reshard import ReshardHandler
from .storage import StorageInfo, WriteResult

# What ``from ... import *`` gives: torch DCP's package names, HyperParallel's, and our own few
# headline names. Every other name above stays importable from here and from its face.
_TORCH_NAMES = [
    "save", "load", "async_save", "save_state_dict", "load_state_dict", "load_sharded_optimizer_state_dict",
    "CheckpointException", "DefaultSavePlanner", "DefaultLoadPlanner", "SavePlanner", "LoadPlanner", "SavePlan",
    "LoadPlan", "WriteItem", "ReadItem", "StorageWriter", "StorageReader", "FileSystemWriter", "FileSystemReader",
    "HuggingFaceStorageReader", "HuggingFaceStorageWriter", "QuantizedHuggingFaceStorageReader", "Metadata",
    "BytesStorageMetadata", "ChunkStorageMetadata", "TensorStorageMetadata",
]
_HYPER_PARALLEL_NAMES = [
    "save", "async_save", "AsyncSaveResponse", "load", "Metadata", "MetadataIndex", "TensorStorageMetadata",
    "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "CHUNK_INFO", "ChunkInfo", "SavePlanner",
    "LoadPlanner", "SavePlan", "LoadPlan", "WriteItem", "ReadItem", "WriteItemType", "LoadItemType",
    "StandardSavePlanner", "StandardLoadPlanner", "StorageWriter", "StorageReader", "StorageInfo", "WriteResult",
    "FileSystemWriter", "FileSystemReader", "get_current_layout", "save_layout", "load_layout", "combine_layout",
    "get_global_layout", "save_checkpoint", "load_checkpoint", "ReshardHandler",
]
_OWN_NAMES = ["StandardPlanner", "offline_transform", "CheckpointManager", "TrainState", "AsyncCheckpointer",
             "verify_checkpoint", "CheckpointError"]
__all__ = list(dict.fromkeys(_TORCH_NAMES + _HYPER_PARALLEL_NAMES + _OWN_NAMES))

"""torch DCP's ``filesystem`` import path: the local/shared filesystem reader and writer.

A face. ``FileSystemWriter``/``FileSystemReader`` are ours (:mod:`._src.backends.filesystem`), with
torch's constructor arguments. ``FileSystemBase``/``FileSystem`` (torch's file-operations
abstraction) and ``SerializationFormat`` (torch's enum) are torch's own, re-exported as plain
protocol and data: our writer accepts ``serialization_format=`` and always writes safetensors.
``TorchFormatWriter`` (ours) is the switch that writes torch DCP's own format instead of ours.
``_StorageInfo`` is torch's private record of where a torch-written item lies (torch's tests
and code reading torch checkpoints import it from here).
"""

from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION as CURRENT_DCP_VERSION  # torch's format's
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemBase, SerializationFormat
from torch.distributed.checkpoint.filesystem import _StorageInfo as _StorageInfo  # torch's private record

from ._src.backends.filesystem import FileSystemReader, FileSystemWriter
from ._src.backends.torch_format import TorchFormatWriter

__all__ = ["FileSystemWriter", "FileSystemReader", "FileSystem", "FileSystemBase", "SerializationFormat",
           "TorchFormatWriter"]

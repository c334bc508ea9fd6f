"""Local and shared filesystem storage (seed path ``distributed_checkpoint.filesystem_storage``).

A face over :mod:`.interop.seed_storage`: ``FileSystemWriter``/``FileSystemReader`` are our
filesystem writer and reader (:mod:`.backends.filesystem`) with HyperParallel's storage calls
added (``configure_writer``/``execute_write``/``finalize_checkpoint``,
``load_metadata``/``configure_reader``/``execute_read``), which write and read HyperParallel's
own files. Given to ``save``/``load`` they write and read our format, as the package's do.

The read pipeline's functions are read from this module at call time, so replacing one here
changes what ``execute_read`` does: ``safe_open`` (how a safetensors file is opened),
``_open_checkpoint_files`` (the cache of open files, an ``_OpenFiles``), ``_fetch_tensor_file``,
``_apply_fetched``, ``BroadcastBatcher`` and ``wait_broadcasts``. ``_get_tensor_size`` is
HyperParallel's shape helper.
"""

import sys

from safetensors import safe_open

from .interop import seed_storage as _seed_storage
from .interop.seed_storage import FileSystemReader, FileSystemWriter
from .interop.seed_storage import OpenFiles as _OpenFiles
from .interop.seed_storage import apply_fetched as _apply_fetched
from .interop.seed_storage import fetch_tensor_file as _fetch_tensor_file
from .interop.seed_storage import open_checkpoint_files as _open_checkpoint_files
from .interop.seed_storage import tensor_size as _get_tensor_size
from .transfer.broadcasts import BroadcastBatcher, wait_broadcasts

__all__ = ["FileSystemWriter", "FileSystemReader", "safe_open", "BroadcastBatcher", "wait_broadcasts",
           "_OpenFiles", "_open_checkpoint_files", "_fetch_tensor_file", "_apply_fetched", "_get_tensor_size"]

_seed_storage.use_patch_points(sys.modules[__name__])

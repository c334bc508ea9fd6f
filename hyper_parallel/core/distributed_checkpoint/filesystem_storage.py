"""Local and shared filesystem storage (HyperParallel's path ``distributed_checkpoint.filesystem_storage``).

A face over :mod:`._src.interop.hyper_parallel.storage_calls`: ``FileSystemWriter``/``FileSystemReader`` are our
filesystem writer and reader (:mod:`._src.backends.filesystem`) with HyperParallel's storage calls
added (``configure_writer``/``execute_write``/``finalize_checkpoint``,
``load_metadata``/``configure_reader``/``execute_read``), which write and read HyperParallel's
own files. Given to ``save``/``load`` they write and read our format, as the package's do.

The read pipeline's functions are read from this module at call time, so replacing one here
changes what ``execute_read`` does: ``safe_open`` (how a safetensors file is opened),
``_open_checkpoint_files`` (the cache of open files, an ``_OpenFiles``), ``_fetch_tensor_file``,
``_apply_fetched``, ``BroadcastBatcher`` and ``wait_broadcasts``. A replaced ``safe_open`` also
serves ``load``'s reads of this library's own data files (valid safetensors files) while it is
in place, as HyperParallel's reader opens every file through it; the library's own ``safe_open``
leaves those reads on the fast path. ``_get_tensor_size`` is HyperParallel's shape helper.
"""

import sys

from safetensors import safe_open

from ._src.interop.hyper_parallel import storage_calls as _storage_calls
from ._src.interop.hyper_parallel.storage_calls import FileSystemReader, FileSystemWriter
from ._src.interop.hyper_parallel.storage_calls import OpenFiles as _OpenFiles
from ._src.interop.hyper_parallel.storage_calls import apply_fetched as _apply_fetched
from ._src.interop.hyper_parallel.storage_calls import fetch_tensor_file as _fetch_tensor_file
from ._src.interop.hyper_parallel.storage_calls import open_checkpoint_files as _open_checkpoint_files
from ._src.interop.hyper_parallel.storage_calls import tensor_size as _get_tensor_size
from ._src.transfer.broadcasts import BroadcastBatcher, wait_broadcasts

__all__ = ["FileSystemWriter", "FileSystemReader", "safe_open", "BroadcastBatcher", "wait_broadcasts",
           "_OpenFiles", "_open_checkpoint_files", "_fetch_tensor_file", "_apply_fetched", "_get_tensor_size"]

_storage_calls.use_patch_points(sys.modules[__name__])

"""HyperParallel's child-process asynchronous save (HyperParallel's path ``distributed_checkpoint.async_persist``).

A face over :mod:`._src.asynchronous.persist_process` (staging to host, the persist child and the
join thread) and :mod:`._src.base.file_exchange` (the ranks' plans and write results exchanged
through files in the checkpoint directory). ``StandardSavePlanner.cached_save_result`` is the
plan cache a child's results are merged into.

``batch_read_worker`` reads the exchange files through this module's ``load_file`` at call
time, and the module holds ``os`` and ``time``, as HyperParallel's tests patch them here.
This library's own ``async_save`` is :mod:`.async_staging`'s.
"""

import os
import time

from ._src.asynchronous.persist_process import (
    AsyncPersistStatus,
    AsyncSaveResponse,
    DataCopier,
    _copy_tensor_to_cpu,
    build_staged_state_dict,
    execute_async_persist,
    execute_async_persist_with_gloo,
    platform,
    resolve_async_persist_result,
)
from ._src.base import file_exchange as _exchange
from ._src.base.file_exchange import COMPLETE_FLAG as _COMPLETE_FLAG
from ._src.base.file_exchange import (
    FileType,
    assemble_file_path,
    construct_file_batches,
    gather_all_results_from_storage,
    load_file,
    parallel_read_files,
    write_file,
)
from ._src.planning.standard_planner import StandardSavePlanner

__all__ = ["AsyncPersistStatus", "AsyncSaveResponse", "DataCopier", "build_staged_state_dict",
           "execute_async_persist", "execute_async_persist_with_gloo", "resolve_async_persist_result", "FileType",
           "assemble_file_path", "construct_file_batches", "batch_read_worker", "parallel_read_files",
           "gather_all_results_from_storage", "load_file", "write_file", "StandardSavePlanner", "platform",
           "_COMPLETE_FLAG", "_copy_tensor_to_cpu", "os", "time"]


def batch_read_worker(file_batch: tuple[int, ...], checkpoint_id: str, file_type: FileType) -> list:
    """Every file of ``file_batch``, polled round-robin until all are complete (see
    :func:`._src.base.file_exchange.batch_read_worker`), read with this module's ``load_file``."""
    return _exchange.batch_read_worker(file_batch, checkpoint_id, file_type,
                                       load=lambda *args: load_file(*args))

"""torch DCP's storage ABCs at the ``storage`` import path, the reader open to HyperParallel's names too.

``StorageWriter`` is torch's ABC. :class:`StorageReader` is a subclass of torch's: a subclass
written for torch implements torch's methods (``reset``, ``read_metadata``,
``set_up_storage_reader``, ``prepare_local_plan``, ``prepare_global_plan``, ``read_data``,
``validate_checkpoint_id``) and is held to them; one written for HyperParallel implements its
names (``load_metadata``, ``configure_reader``, ``execute_read``) and is run by them. Either runs
under this library's ``load`` (``engine/protocol_run.py``).

This library's own storage protocol (bytes and files: ``read_metadata_bytes``, ``file_size``,
``read_into``, ...) is :mod:`.protocol`; its backends implement that one.
"""

from __future__ import annotations

from torch.distributed.checkpoint import storage as _torch_storage

from ..base.either_protocol import EitherProtocol

__all__ = ["StorageWriter", "StorageReader", "HYPER_PARALLEL_READER_NAMES"]

HYPER_PARALLEL_READER_NAMES = ("load_metadata", "configure_reader", "execute_read")

StorageWriter = _torch_storage.StorageWriter


class StorageReader(_torch_storage.StorageReader, metaclass=EitherProtocol):
    """torch DCP's ``StorageReader`` (see the module docstring for HyperParallel's form)."""

    _HYPER_PARALLEL_NAMES = HYPER_PARALLEL_READER_NAMES

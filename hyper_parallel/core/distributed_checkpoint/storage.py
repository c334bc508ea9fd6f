"""Storage protocols (HyperParallel's path ``distributed_checkpoint.storage``).

A face. ``StorageWriter``/``StorageReader`` are torch's ABCs (the reader open to HyperParallel's
method names: :mod:`._src.backends.torch_abcs`): storage written for torch or HyperParallel subclasses
them and runs under ``save``/``load`` on its protocol. This library's own storage protocol, which
its backends implement (bytes and files), is :mod:`._src.backends.protocol`, where the call order of
every method is documented. Also :mod:`._src.transfer.saver` for ``WriteResult`` (what a rank's
writes produced: files and chunk records; or, in HyperParallel's and torch's per-item form,
``WriteResult(index=, storage_data=)``),
and :mod:`._src.format.storage_info` for HyperParallel's ``StorageInfo``. ``METADATA_FILE_NAME`` is the
checkpoint's metadata file, ``.metadata`` as in torch DCP.
"""

from ._src.backends.torch_abcs import StorageReader, StorageWriter
from ._src.format.metadata import METADATA_FILE as METADATA_FILE_NAME
from ._src.format.storage_info import StorageInfo
from ._src.transfer.saver import WriteResult

__all__ = ["StorageWriter", "StorageReader", "WriteResult", "StorageInfo", "METADATA_FILE_NAME"]

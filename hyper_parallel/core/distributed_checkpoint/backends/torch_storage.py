"""torch DCP's storage objects as plain configuration: torch's ``FileSystemWriter``/``FileSystemReader``
and ``FsspecWriter``/``FsspecReader`` mapped onto this library's.

What maps (torch option -> here):

- ``path`` -> the same directory or fsspec URL; an fsspec object's storage options (its
  filesystem's ``storage_options``) -> the same options.
- ``sync_files``, ``thread_count`` (data files and writer threads per rank), ``overwrite``
  -> the same options.
- ``single_file_per_rank=True`` (torch's default): each rank writes ``thread_count`` data files
  either way; False (a file per tensor) is refused.
- ``per_thread_copy_ahead``: torch's bound on device->host copies queued ahead of its writer
  threads; writes here go through a fixed pool of aligned buffers, so any value is accepted.
- ``cache_staged_state_dict``: async saves here always reuse their staging buffers; either
  value is accepted.
- ``serialization_format``: data files are safetensors here either way.
- ``_extensions`` (stream transforms such as compression): refused unless empty.

A user subclass of a torch storage class with methods of its own (``write_data``,
``read_data`` ...) is refused, naming the class and this library's ABC to implement instead.

What it is not: the backends themselves (:mod:`.filesystem`, :mod:`.fsspec`) nor the choice
of backend from a URL (:mod:`.resolve`).
"""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.checkpoint import filesystem as _torch_fs
from torch.distributed.checkpoint import storage as _torch_storage

from ..base.errors import UnsupportedValueError
from ..base.overrides import foreign_base, own_methods
from .filesystem import FileSystemReader, FileSystemWriter
from .fsspec import FsspecReader, FsspecWriter
from .protocol import StorageReader, StorageWriter

__all__ = ["as_our_writer", "as_our_reader"]

_OWN = {  # what a torch subclass's methods do here instead
    "writer": "implement hyper_parallel's StorageWriter ABC (set_up, prepare, write_file, commit, "
              "read_committed, remove; storage.py documents the call order) or pass FileSystemWriter / FsspecWriter",
    "reader": "implement hyper_parallel's StorageReader ABC (set_up, read_metadata, file_size, read_into; "
              "storage.py documents the call order) or pass FileSystemReader / FsspecReader",
}


def _fsspec_classes() -> tuple[type | None, type | None]:
    try:  # torch's fsspec module needs fsspec installed
        from torch.distributed.checkpoint import _fsspec_filesystem as f
    except ImportError:  # pragma: no cover - fsspec is a dependency of the s3 extra
        return None, None
    return f.FsspecWriter, f.FsspecReader


def _refuse(obj: Any, role: str) -> None:
    cls = type(obj)
    name = f"{cls.__module__}.{cls.__qualname__}"
    own = own_methods(cls)
    base = foreign_base(cls)
    if own:
        raise UnsupportedValueError(
            f"storage_{role}={name} subclasses torch.distributed.checkpoint's {base.__qualname__} and overrides "
            f"{', '.join(own)}: this library never calls torch's storage hooks, so that code would be silently "
            f"skipped. Instead, {_OWN[role]}")
    raise UnsupportedValueError(
        f"storage_{role}={name}: of torch.distributed.checkpoint's storage classes only FileSystemWriter/"
        f"FileSystemReader and FsspecWriter/FsspecReader are taken as configuration; use this library's class "
        f"of the same name where it has one (from hyper_parallel.core.distributed_checkpoint import ...), or "
        f"{_OWN[role].split(' or ')[-1]}")


def as_our_writer(writer: Any) -> Any:
    """The writer of ours that ``writer`` stands for: a torch ``FileSystemWriter`` or
    ``FsspecWriter`` (or a subclass adding only ``__init__``) -> ours with its options; any
    other torch writer -> an error naming it; anything else is returned as it is.

    Raises:
        UnsupportedValueError: a torch writer with code of its own, or an option with no
            counterpart here (``single_file_per_rank=False``, ``_extensions``).
    """
    if writer is None or isinstance(writer, StorageWriter) or not isinstance(writer, _torch_storage.StorageWriter):
        return writer
    fsspec_writer, _ = _fsspec_classes()
    base = foreign_base(type(writer))
    if own_methods(type(writer)) or base not in (_torch_fs.FileSystemWriter, _torch_fs._FileSystemWriter,
                                                 fsspec_writer):
        _refuse(writer, "writer")
    what = f"storage_writer={type(writer).__name__}({os.fspath(writer.path)!r})"
    if not writer.single_file_per_rank:
        raise UnsupportedValueError(
            f"{what}: single_file_per_rank=False (a file per tensor) is not supported; each rank writes "
            "thread_count safetensors data files. Leave single_file_per_rank=True (pass thread_count= for more files)")
    extensions = getattr(getattr(writer, "transforms", None), "extensions", ())
    if extensions:
        raise UnsupportedValueError(
            f"{what}: _extensions={list(extensions)!r} (stream transforms such as compression) are not supported: "
            "data files are plain safetensors, checksummed per block. Pass no _extensions")
    if base is fsspec_writer:
        ours: Any = FsspecWriter(os.fspath(writer.path), **_storage_options(writer))
        ours.overwrite = writer.overwrite
        ours.thread_count = writer.thread_count  # save() takes a writer's thread_count as torch's does
        return ours
    return FileSystemWriter(writer.path, sync_files=writer.sync_files, thread_count=writer.thread_count,
                            overwrite=writer.overwrite)


def as_our_reader(reader: Any) -> Any:
    """The reader of ours that ``reader`` stands for (as :func:`as_our_writer` does for writers).

    Raises:
        UnsupportedValueError: a torch reader with code of its own.
    """
    if reader is None or isinstance(reader, StorageReader) or not isinstance(reader, _torch_storage.StorageReader):
        return reader
    _, fsspec_reader = _fsspec_classes()
    base = foreign_base(type(reader))
    if own_methods(type(reader)) or base not in (_torch_fs.FileSystemReader, fsspec_reader):
        _refuse(reader, "reader")
    if base is fsspec_reader:
        return FsspecReader(os.fspath(reader.path), **_storage_options(reader))
    return FileSystemReader(reader.path)


def _storage_options(storage: Any) -> dict[str, Any]:
    """The options torch's fsspec object opened its filesystem with (fsspec keeps them)."""
    return dict(getattr(getattr(storage.fs, "fs", None), "storage_options", None) or {})

"""torch DCP's storage objects as plain configuration: torch's ``FileSystemWriter``/``FileSystemReader``
and ``FsspecWriter``/``FsspecReader`` mapped onto this library's.

What maps (torch option -> here):

- ``path`` -> the same directory or fsspec URL; an fsspec object's storage options (its
  filesystem's ``storage_options``) -> the same options.
- ``sync_files``, ``thread_count`` (data files and writer threads per rank), ``overwrite``
  -> the same options.
- ``single_file_per_rank`` (a file per rank, or torch's file per tensor): each rank writes
  ``thread_count`` data files either way (the data and what loads it are the same; a file per
  tensor would only multiply opens), as our own ``FileSystemWriter`` does.
- ``per_thread_copy_ahead``: torch's bound on device->host copies queued ahead of its writer
  threads; writes here go through a fixed pool of aligned buffers, so any value is accepted.
- ``cache_staged_state_dict``: async saves here always reuse their staging buffers; either
  value is accepted.
- ``serialization_format``: data files are safetensors here either way.
- ``_extensions`` (stream transforms such as compression): refused unless empty.

torch's storage classes whose counterparts live in a higher layer (its Hugging Face reader and
writers) are converted by the conversion that layer registers (:mod:`.storage_mappings`).

A storage object with code of its own (a subclass of a torch storage class overriding
``write_data``, ``read_data`` ..., torch's other storage classes, any object on torch's
``StorageWriter``/``StorageReader`` protocol: :func:`is_torch_writer`/:func:`is_torch_reader`)
is not mapped: ``save``/``load`` run it through torch's protocol (:mod:`..engine.protocol_run`),
calling its hooks; callers that cannot (``async_save``) get it refused, naming the class.
:func:`as_torch_writer` is the way back: one of our writers as torch's, for a save that runs a
torch-protocol planner (it then writes torch's format, which ``load`` reads in place).

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
from .storage_mappings import convert
from .torch_format import TorchFormatWriter

__all__ = ["as_our_writer", "as_our_reader", "is_torch_writer", "is_torch_reader", "as_torch_writer"]

_OWN = {  # what a torch subclass's methods do here instead
    "writer": "implement hyper_parallel's StorageWriter ABC (set_up, prepare, write_file, commit, "
              "read_committed, remove; storage.py documents the call order) or pass FileSystemWriter / FsspecWriter",
    "reader": "implement hyper_parallel's StorageReader ABC (set_up, read_metadata_bytes, file_size, read_into; "
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
            f"{', '.join(own)}: async_save never calls torch's storage hooks (save and load do), so that code would "
            f"be silently skipped. Instead, {_OWN[role]}")
    raise UnsupportedValueError(
        f"storage_{role}={name}: of torch.distributed.checkpoint's storage classes only FileSystemWriter/"
        f"FileSystemReader and FsspecWriter/FsspecReader are taken as configuration; use this library's class "
        f"of the same name where it has one (from hyper_parallel.core.distributed_checkpoint import ...), or "
        f"{_OWN[role].split(' or ')[-1]}")


_WRITER = ("reset", "set_up_storage_writer", "prepare_local_plan", "prepare_global_plan", "write_data", "finish")
_READER = ("reset", "read_metadata", "set_up_storage_reader", "prepare_local_plan", "prepare_global_plan",
           "read_data")


def is_torch_writer(writer: Any) -> bool:
    """Whether ``writer`` speaks torch DCP's ``StorageWriter`` protocol (an instance of torch's ABC,
    or an object with its methods) and is not one of ours."""
    if writer is None or isinstance(writer, StorageWriter):
        return False
    return isinstance(writer, _torch_storage.StorageWriter) or all(callable(getattr(writer, m, None))
                                                                    for m in _WRITER)


def is_torch_reader(reader: Any) -> bool:
    """Whether ``reader`` speaks torch DCP's ``StorageReader`` protocol and is not one of ours."""
    if reader is None or isinstance(reader, StorageReader):
        return False
    return isinstance(reader, _torch_storage.StorageReader) or all(callable(getattr(reader, m, None))
                                                                    for m in _READER)


def _mapped(storage: Any, classes: tuple[Any, ...]) -> bool:
    """Whether torch's ``storage`` is one of ``classes`` with nothing of its own (options only)."""
    return not own_methods(type(storage)) and foreign_base(type(storage)) in classes


def as_our_writer(writer: Any, foreign_ok: bool = False) -> Any:
    """The writer of ours that ``writer`` stands for: a torch ``FileSystemWriter`` or
    ``FsspecWriter`` (or a subclass adding only ``__init__``) -> ours with its options; any
    other torch writer -> itself with ``foreign_ok`` (the caller runs torch's protocol), else an
    error naming it; anything else is returned as it is.

    Raises:
        UnsupportedValueError: a torch writer with code of its own (unless ``foreign_ok``), or an
            option with no counterpart here (``_extensions``).
    """
    if writer is None or isinstance(writer, StorageWriter) or not isinstance(writer, _torch_storage.StorageWriter):
        return writer
    if isinstance(writer, TorchFormatWriter):  # the switch: torch's format, written on torch's protocol
        if foreign_ok:
            return writer
        raise UnsupportedValueError(f"{type(writer).__name__} writes torch's format on torch's protocol: pass it to "
                                    "save(); async_save runs this library's writers only")
    registered = convert(writer, "writer")  # e.g. torch's HuggingFaceStorageWriter
    if registered is not None:
        return registered
    fsspec_writer, _ = _fsspec_classes()
    base = foreign_base(type(writer))
    if not _mapped(writer, (_torch_fs.FileSystemWriter, _torch_fs._FileSystemWriter, fsspec_writer)):
        if foreign_ok:
            return writer
        _refuse(writer, "writer")
    what = f"storage_writer={type(writer).__name__}({os.fspath(writer.path)!r})"
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


def as_our_reader(reader: Any, foreign_ok: bool = False) -> Any:
    """The reader of ours that ``reader`` stands for (as :func:`as_our_writer` does for writers).

    Raises:
        UnsupportedValueError: a torch reader with code of its own (unless ``foreign_ok``).
    """
    if reader is None or isinstance(reader, StorageReader) or not isinstance(reader, _torch_storage.StorageReader):
        return reader
    registered = convert(reader, "reader")  # e.g. torch's HuggingFaceStorageReader
    if registered is not None:
        return registered
    _, fsspec_reader = _fsspec_classes()
    base = foreign_base(type(reader))
    if not _mapped(reader, (_torch_fs.FileSystemReader, fsspec_reader)):
        if foreign_ok:
            return reader
        _refuse(reader, "reader")
    if base is fsspec_reader:
        return FsspecReader(os.fspath(reader.path), **_storage_options(reader))
    return FileSystemReader(reader.path)


def _storage_options(storage: Any) -> dict[str, Any]:
    """The options torch's fsspec object opened its filesystem with (fsspec keeps them)."""
    return dict(getattr(getattr(storage.fs, "fs", None), "storage_options", None) or {})


def as_torch_writer(writer: Any, where: str | None) -> Any:
    """torch's writer for one of ours (or for ``where`` when ``writer`` is None): a save that runs
    a torch-protocol planner writes through torch's ``FileSystemWriter``/``FsspecWriter`` with
    the same place and options (torch's format, which ``load`` reads in place).

    Raises:
        UnsupportedValueError: a writer of ours torch has no counterpart for (Hugging Face ...).
    """
    from .locations import is_url

    if writer is None:
        if where is None:
            raise ValueError("say where the checkpoint is: path=/checkpoint_id= or a storage writer")
        if is_url(where):
            fsspec_writer, _ = _fsspec_classes()
            return fsspec_writer(where)
        return _torch_fs.FileSystemWriter(where)
    if isinstance(writer, FsspecWriter):
        fsspec_writer, _ = _fsspec_classes()
        out = fsspec_writer(writer.url, overwrite=writer.overwrite, **dict(writer._options))
        out.thread_count = getattr(writer, "thread_count", 1)
        return out
    if type(writer) is FileSystemWriter:
        return _torch_fs.FileSystemWriter(writer.path, sync_files=writer.sync_files, thread_count=writer.thread_count,
                                          overwrite=writer.overwrite)
    raise UnsupportedValueError(
        f"storage_writer={type(writer).__name__}: a torch-protocol planner saves through torch's storage protocol, "
        "which this writer does not speak; pass FileSystemWriter/FsspecWriter, a torch storage writer, or a planner "
        "of this library")

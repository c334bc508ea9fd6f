"""A checkpoint torch DCP wrote, read in place through this library's storage, without running code.

:class:`TorchFormatReader` is a reader on torch DCP's storage protocol (a subclass of torch's
``StorageReader``: ``read_metadata``, ``set_up_storage_reader``, ``prepare_local_plan``,
``prepare_global_plan``, ``read_data``) for the format torch's ``FileSystemWriter`` writes
(single file per rank or not, with or without dedup, any number of threads): a pickled
``.metadata`` and data files of ``torch.save`` items. It reads bytes through one of this
library's readers (local files, fsspec URLs), so the storage's own checks apply (no symbolic
links, ranges checked against the file's size before a buffer is allocated, bounded calls),
and it decodes through :mod:`..format.torch_pickles`: the metadata by an allowlist unpickler,
tensor items and byte items with ``torch.load(weights_only=True)``. A byte item is decoded
before the planner's ``load_bytes`` gets it, so a hostile pickle fails here, naming the key,
whatever the planner does with the bytes afterwards.

It reads a chunk once however many read items use it (resharding splits one saved chunk over
several targets), files in name order, items in byte order.

:func:`safe_metadata_reads` covers torch's own readers run with hooks of their own: one that
inherits torch's ``FileSystemReader.read_metadata`` (a plain ``pickle.load``) reads ``.metadata``
with the same allowlist unpickler while a load runs.

What it is not: the procedure that calls it (:mod:`..engine.protocol_run`), our own format's
readers (:mod:`.filesystem`, :mod:`.fsspec`), the conversion into our format
(``import_torch_dcp``).
"""

from __future__ import annotations

import contextlib
import io
import os
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Any

from torch.distributed.checkpoint import filesystem as _torch_fs
from torch.distributed.checkpoint import metadata as _torch_md
from torch.distributed.checkpoint import planner as _torch_planner
from torch.distributed.checkpoint import storage as _torch_storage

from ..base.errors import CheckpointError, CorruptCheckpointError, UnsupportedValueError
from ..format.metadata import METADATA_FILE
from ..format.torch_pickles import (
    check_chunks_in_files,
    is_pickle,
    load_bytes_item,
    load_tensor_item,
    read_torch_metadata,
)
from .protocol import StorageReader, check_range

__all__ = ["TorchFormatReader", "TorchFormatWriter", "safe_metadata_reads", "is_pickle", "stored_bytes"]


def stored_bytes(storage: StorageReader, name: str = METADATA_FILE) -> bytes:
    """The whole file ``name`` of ``storage``'s checkpoint, read through ``file_size``/``read_into``."""
    size = storage.file_size(name)
    buf = bytearray(size)
    if size:
        storage.read_into(name, 0, memoryview(buf))
    return bytes(buf)


class TorchFormatReader(_torch_storage.StorageReader):
    """torch DCP's checkpoint format read through one of our readers, on torch's reader protocol.

    Args:
        storage: this library's reader of the checkpoint's location (``FileSystemReader``,
            ``FsspecReader``); its ``file_size``/``read_into`` serve every byte.
        raw_metadata: the ``.metadata`` bytes when the caller already read them (the
            coordinator reads once and broadcasts); None: read on first ``read_metadata()``.
        allow_pickle: byte items may be unpickled beyond ``weights_only`` rules (the caller's
            opt-in); ``.metadata`` is read by the allowlist unpickler regardless.
        files_checked: the caller already checked every chunk against its file's size
            (:func:`~..format.torch_pickles.check_chunks_in_files`); otherwise ``read_metadata``
            does, once per reader.

    Example::

        reader = TorchFormatReader(FileSystemReader("/ckpt/torch_step100"))
        meta = reader.read_metadata()          # torch's Metadata, nothing executed
    """

    def __init__(self, storage: StorageReader, raw_metadata: bytes | None = None, allow_pickle: bool = False,
                 files_checked: bool = False) -> None:
        super().__init__()
        self.storage = storage
        self.allow_pickle = allow_pickle
        self._raw = raw_metadata
        self._meta: Any = None
        self._files_checked = files_checked
        self.storage_data: dict[Any, Any] = {}
        self.load_id = uuid.uuid4().hex
        self.rank: int | None = None
        self.is_coordinator = False

    @property
    def checkpoint_id(self) -> str:
        """Where the checkpoint is (the storage's path or URL)."""
        return str(getattr(self.storage, "path", None) or getattr(self.storage, "url", None) or "")

    @property
    def where(self) -> str:
        root = self.checkpoint_id
        return f"{root.rstrip('/')}/{METADATA_FILE}" if root else METADATA_FILE

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """torch's ``reset``: a new load (and, with ``checkpoint_id``, another checkpoint)."""
        if checkpoint_id:
            self.storage.reset(os.fspath(checkpoint_id))
            self._raw, self._meta, self._files_checked = None, None, False
        self.storage_data = {}
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> _torch_md.Metadata:
        """torch's ``Metadata`` of the checkpoint, unpickled by the allowlist unpickler and checked
        (fields, chunk geometry, each chunk inside its file); parsed once per reader.

        Raises:
            MetadataError: a refused global (named, never run) or a malformed record.
            CorruptCheckpointError: a chunk lies beyond its file's end.
        """
        if self._meta is None:
            raw = self._raw if self._raw is not None else stored_bytes(self.storage)
            meta = read_torch_metadata(raw, self.where)
            if not self._files_checked:
                check_chunks_in_files(meta, self.storage.file_size, self.where)
                self._files_checked = True
            self._meta = meta
        meta = self._meta
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = _torch_md.StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta

    def set_up_storage_reader(self, metadata: _torch_md.Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        """torch's call with the metadata every planner saw: remember where each item is stored."""
        self.storage_data = metadata.storage_data
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.storage.set_up(self.rank or 0, is_coordinator)

    def prepare_local_plan(self, plan: _torch_planner.LoadPlan) -> _torch_planner.LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[_torch_planner.LoadPlan]) -> list[_torch_planner.LoadPlan]:
        return plans

    def read_data(self, plan: _torch_planner.LoadPlan, planner: _torch_planner.LoadPlanner) -> Future[None]:
        """Read every item of ``plan`` and hand it to ``planner`` as torch's reader does
        (``resolve_tensor`` -> copy -> ``commit_tensor``; ``load_bytes`` with a ``BytesIO``),
        each stored item read and decoded once.

        Raises:
            CorruptCheckpointError: an item's range lies beyond its file, its bytes do not
                decode, or its shape does not match the read item (names the key and file).
            UnsupportedValueError: a byte item needs a global weights-only loading refuses
                (never run); ``allow_pickle=True`` loads it.
        """
        by_stored: dict[Any, list[Any]] = {}
        for item in plan.items:
            by_stored.setdefault(item.storage_index, []).append(item)
        located = []
        for index, items in by_stored.items():
            info = self.storage_data.get(index)
            if info is None:
                raise CorruptCheckpointError(f"{self.where}: {index.fqn!r}: the plan reads an item at "
                                             f"{_offsets(index)} that the checkpoint does not store")
            located.append((info.relative_path, info.offset, index, info, items))
        located.sort(key=lambda t: (t[0], t[1]))
        for name, offset, index, info, items in located:
            where = f"{self.checkpoint_id.rstrip('/')}/{name}" if self.checkpoint_id else name
            check_range(self.storage, name, offset, info.length, f"{index.fqn!r}")
            descriptors = getattr(info, "transform_descriptors", None)
            view = _RangeView(self.storage, name, offset, info.length)
            if items[0].type == _torch_planner.LoadItemType.BYTE_IO:
                data = _untransformed(view.read(), descriptors, index.fqn, where)
                load_bytes_item(data, index.fqn, where, self.allow_pickle)  # refused here if hostile
                for item in items:
                    planner.load_bytes(item, io.BytesIO(data))
                continue
            # torch.load reads the archive through the view: each record once, straight from storage
            source = io.BytesIO(_untransformed(view.read(), descriptors, index.fqn, where)) if descriptors else view
            stored = load_tensor_item(source, index.fqn, where)
            for item in items:
                piece = _narrow(stored, item.storage_offsets, item.lengths, index.fqn, where)
                target = planner.resolve_tensor(item).detach()
                if target.size() != piece.size():
                    raise CorruptCheckpointError(
                        f"{where}: {index.fqn!r}: the stored piece has size {list(piece.size())} where the target "
                        f"expects {list(target.size())} (read item at {list(item.dest_offsets)})")
                target.copy_(piece)
                planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def close(self) -> None:
        """Release the storage's open files."""
        self.storage.close()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


class _RangeView(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of one file of ``storage`` as a read-only, seekable file
    (what ``torch.load`` reads a ``torch.save`` archive from), served by ``storage.read_into``.
    The caller checked the range against the file's size."""

    def __init__(self, storage: StorageReader, name: str, offset: int, length: int) -> None:
        super().__init__()
        self.storage, self.name, self.offset, self.length, self.pos = storage, name, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        if n:
            self.storage.read_into(self.name, self.offset + self.pos, memoryview(buffer).cast("B")[:n])
            self.pos += n
        return n

    def read(self, size: int = -1) -> bytes:
        n = self.length - self.pos if size is None or size < 0 else min(size, self.length - self.pos)
        out = bytearray(max(n, 0))
        got = self.readinto(out)
        return bytes(out[:got]) if got != len(out) else bytes(out)


def _offsets(index: Any) -> list[int] | None:
    return list(index.offset) if index.offset is not None else None


def _narrow(tensor: Any, offsets: Sequence[int], lengths: Sequence[int], key: str, where: str) -> Any:
    if len(offsets) != tensor.dim() or len(lengths) != tensor.dim() or any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, tensor.shape, strict=True)):
        raise CorruptCheckpointError(f"{where}: {key!r}: the read of {list(lengths)} at {list(offsets)} lies outside "
                                     f"the stored chunk of size {list(tensor.shape)}")
    for dim, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
        tensor = tensor.narrow(dim, o, n)
    return tensor


def _untransformed(raw: bytearray, descriptors: Sequence[str] | None, key: str, where: str) -> bytes | bytearray:
    """The item's bytes with torch's stream transforms (``_extensions``, e.g. zstd) undone, by
    torch's registry of the extensions it knows (data transforms; nothing from the file runs)."""
    if not descriptors:
        return raw
    from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

    try:
        stream: Any = io.BytesIO(raw)
        for ext in ExtensionRegistry().from_descriptor_list(list(descriptors)):
            if isinstance(ext, StreamTransformExtension):
                stream = ext.transform_from(stream)
        return stream.read()
    except CheckpointError:
        raise
    except (ValueError, ImportError) as exc:
        raise UnsupportedValueError(f"{where}: {key!r} was written through torch's stream transforms "
                                    f"{list(descriptors)}, which cannot be undone here ({exc})") from None
    except Exception as exc:
        raise CorruptCheckpointError(f"{where}: {key!r}: undoing its stream transforms {list(descriptors)} failed "
                                     f"({type(exc).__name__}: {exc})") from None


@contextlib.contextmanager
def safe_metadata_reads(reader: Any) -> Iterator[Any]:
    """While the block runs, a reader that inherits torch's ``FileSystemReader.read_metadata``
    (``pickle.load`` of ``.metadata``: torch's ``FileSystemReader``/``FsspecReader`` subclasses
    with hooks of their own) reads it with the allowlist unpickler instead, through the reader's
    own file system (``fs.create_stream``), as torch's would (``rank=``: the rank-local file;
    ``storage_meta.load_id`` set). A reader's own ``read_metadata`` is the caller's code and runs
    as written. Restored afterwards; yields ``reader``."""
    inherited = getattr(type(reader), "read_metadata", None) is _torch_fs.FileSystemReader.read_metadata
    if not inherited or "read_metadata" in vars(reader):
        yield reader
        return

    def read_metadata(*args: Any, **kwargs: Any) -> _torch_md.Metadata:
        path = reader._get_metadata_path(kwargs.get("rank"))
        with reader.fs.create_stream(path, "rb") as stream:
            meta = read_torch_metadata(stream.read(), os.fspath(path))
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = _torch_md.StorageMeta()
        meta.storage_meta.load_id = reader.load_id
        return meta

    reader.read_metadata = read_metadata
    try:
        yield reader
    finally:
        with contextlib.suppress(AttributeError):
            del reader.read_metadata


class TorchFormatWriter(_torch_fs.FileSystemWriter):
    """The switch for writing torch DCP's own format: a checkpoint stock ``torch.distributed.checkpoint``
    2.13 loads as its own (for a team whose other tools still read torch's format).

    It is torch's ``FileSystemWriter`` with torch's arguments; our ``save`` runs it on torch's
    protocol (``engine/protocol_run.py``) with torch's default save planner, so the files, the
    pickled ``.metadata`` and their layout are torch's. Our ``load`` reads the result directly
    (torch-written checkpoints load without conversion). What our format adds is not there:
    checksums, incremental steps, rank-local fragments.

    Example::

        save(sd, storage_writer=TorchFormatWriter("/ckpt/step100"))
        torch.distributed.checkpoint.load(sd, checkpoint_id="/ckpt/step100")   # stock torch
    """

"""Safetensors directories as storage readers: load and reshard straight from their files.

Two kinds of directory, one reader each (what makes one kind valid makes the other wrong):

- ``load(sd, storage_reader=HuggingFaceStorageReader(hf_dir))`` reads a directory as
  ``save_pretrained`` writes it: ``model.safetensors``, or the files that
  ``model.safetensors.index.json`` names; every tensor whole in one file. Nothing else in the
  directory is read (a stray ``consolidated.safetensors`` beside them is ignored). Without
  either, every ``*.safetensors`` file, as torch's reader reads it, where the names show the
  set is whole (:func:`.index.indexless_files`: no numbered shard of the set missing).
- ``load(sd, storage_reader=TorchShardedSafetensorsReader(dir))`` reads what torch's
  ``HuggingFaceStorageWriter(path, save_distributed=True)`` writes before consolidating:
  every ``*.safetensors`` file of the directory holds some ranks' shards, under the tensors'
  own names, and its header's ``__metadata__["DCP_SHARDING_INFO"]`` (a JSON string) gives
  each shard's ``saved_offsets`` in the whole tensor. There is no index.

No conversion step, no copy.

How foreign files fit the loader: the reader *presents* the directory as a checkpoint of
this library. Its ``read_metadata_bytes`` parses the safetensors headers and returns a format-v2
``..metadata`` in which every tensor is one table-stored chunk (its whole box) in one file
record per safetensors file (for torch's shards: one table chunk per shard, each file's shard
of a key having id 0 in that file); each record's "index" is the file's JSON header (offset
8, its length and crc32c). On every rank, ``file_index`` reads a file's header again, checks
it against that crc32c (a file rewritten while loading is an error, not a mix of two
versions) and returns an :class:`~..data_file.UncheckedIndex`: where each tensor's bytes start. From
there the loader is the ordinary one: a rank intersects its targets with the chunks and
reads only the overlapping byte ranges (a ``Shard(0)`` rank reads only its rows), a target
of another dtype is converted, and ``strict`` behaves as for any checkpoint.

What is not checked: safetensors files carry no checksums, so bytes are read as they are
(``verify`` has nothing to verify for them). Headers are validated the way safetensors
validates them before anything is allocated or read: the 8-byte length, JSON, known dtypes,
shapes, and data offsets that tile the data area exactly (no overlap, no hole, nothing past
the end of the file). The shards of a torch directory must tile each tensor exactly: no
overlap, no hole (a file of a shard in the middle is missing); the headers do not record a
tensor's full shape, so it is the extent of its shards, and a missing file that held only
the last rows of every tensor makes them look smaller: a target of the right shape then fails
the load with a shape mismatch. Errors name the file and the key. Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import crc32c
import numpy as np

from ...backends.fsspec import FsspecReader
from ...backends.locations import checkpoint_path, is_url, local_path
from ...backends.protocol import Buffer, StorageReader
from ...base.box import Box, first_overlap, uncovered
from ...base.errors import (
    CheckpointError,
    CorruptCheckpointError,
    MetadataError,
    NotACheckpointError,
    UnsupportedValueError,
)
from ...base.limits import MAX_ELEMENTS
from ...format import metadata as md
from ...format.data_file import UncheckedIndex
from ...format.safetensors import HEAD, LocalFiles, SafetensorsHeader, parse_header, read_header
from ...format.validation import validate_file_name
from .index import (
    DCP_SHARDING_INFO_KEY,
    HF_INDEX,
    HF_SINGLE,
    MAX_INDEX_BYTES,
    SAFETENSORS_INDEX_SUFFIX,
    SAVED_OFFSETS_KEY,
    indexless_files,
    parse_weight_map,
)
from .protocols import ProtocolReads

# torch's HuggingFaceStorageWriter records each tensor's place in the whole tensor here (a
# JSON string: {name: {"saved_offsets": [...]}}); a non-zero offset means a shard.
_TORCH_SHARDING = DCP_SHARDING_INFO_KEY
_SAVED_OFFSETS = SAVED_OFFSETS_KEY
_SUFFIX = ".safetensors"
_INDEX_SUFFIX = SAFETENSORS_INDEX_SUFFIX
_TORCH_SHARD_NAME = re.compile(r"shard-(\d+)-model-\d+-of-\d+\.safetensors")


# What these readers refuse a directory for is both an error of ours and the builtin class
# HyperParallel's readers raise for the same fault (its callers catch ValueError and
# FileNotFoundError), so code written for either catches it.
class SafetensorsFormatError(CorruptCheckpointError, ValueError):
    """A file of the directory contradicts the safetensors format or the other files: a damaged
    header, a tensor in two files, an index naming a tensor its file lacks, torch shards that
    overlap, leave a hole or disagree on dtype. The message names the file and the tensor."""


class SafetensorsUnsupportedError(UnsupportedValueError, ValueError):
    """What the reader cannot load: a sub-byte dtype (F4, F6), or a directory of the other kind
    (torch's shards for :class:`HuggingFaceStorageReader`, whole tensors for
    :class:`TorchShardedSafetensorsReader`; the message names the reader to use)."""


class SafetensorsFileMissingError(CorruptCheckpointError, FileNotFoundError):
    """A file ``model.safetensors.index.json`` names is not in the directory (an incomplete download)."""


def _classified(exc: CheckpointError) -> CheckpointError:
    """A header error of the format layer as one of the classes above (same message), so that a
    damaged file is a ValueError here as for HyperParallel's readers."""
    if isinstance(exc, ValueError):
        return exc
    cls = SafetensorsUnsupportedError if isinstance(exc, UnsupportedValueError) else SafetensorsFormatError
    return cls(*exc.args).with_traceback(exc.__traceback__)


def torch_saved_offsets(header: SafetensorsHeader, where: str,
                        strict: bool = True) -> dict[str, tuple[int, ...]] | None:
    """Where each tensor of a file sits in its whole tensor, as torch's HuggingFaceStorageWriter
    records it (``DCP_SHARDING_INFO``), or None for a file that records nothing.

    Raises SafetensorsFormatError when the record is not a JSON object, or (``strict``) lacks
    valid offsets (one integer >= 0 per dim) for a tensor of the file; not ``strict``, such
    tensors are left out.
    """
    info = header.extra.get(_TORCH_SHARDING)
    if info is None:
        return None
    try:
        doc = json.loads(info)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise SafetensorsFormatError(f"{where}: {_TORCH_SHARDING} in its header is not a JSON object")
    out: dict[str, tuple[int, ...]] = {}
    for name, t in header.tensors.items():
        rec = doc.get(name)
        offsets = rec.get(_SAVED_OFFSETS) if isinstance(rec, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != len(t.shape)
                or not all(type(o) is int and 0 <= o < MAX_ELEMENTS for o in offsets)):
            if not strict:
                continue
            raise SafetensorsFormatError(
                f"{where}: {_TORCH_SHARDING} in its header gives tensor {name!r} (shape {list(t.shape)}) no "
                f"valid {_SAVED_OFFSETS} (one integer >= 0 per dim), found {rec!r:.80}; the header is damaged")
        out[name] = tuple(offsets)
    return out


class _LocalFiles(LocalFiles, StorageReader):
    """:class:`~...format.safetensors.LocalFiles` as a storage reader: a local directory read by
    :class:`HuggingFaceStorageReader`. Unlike :class:`~...backends.filesystem.FileSystemReader`
    it follows symbolic links (the Hugging Face hub cache). Names come only from the index
    (validated plain names) or are fixed.
    """

    def read_metadata_bytes(self) -> bytes:
        raise NotImplementedError("a Hugging Face directory has no .metadata")

    @property
    def memory_backed(self) -> bool:
        from ...backends.direct_io import is_memory_filesystem

        return is_memory_filesystem(self.path)

    def list_files(self) -> list[str]:
        return sorted(e.name for e in os.scandir(self.path) if e.is_file())


class HuggingFaceStorageReader(ProtocolReads, StorageReader):
    """Reads a Hugging Face safetensors checkpoint directory as if it were a checkpoint of ours.

    Pass it to :func:`~..api.load` instead of a path: every rank reads only the byte ranges
    its targets need, straight into them, whatever their layout::

        load(model.state_dict(), storage_reader=HuggingFaceStorageReader("/models/llama"))
        sd = load(storage_reader=HuggingFaceStorageReader("/models/llama"))  # full CPU tensors

    The files read are the ones ``model.safetensors.index.json`` names (its ``weight_map``),
    or ``model.safetensors`` alone when there is no index, or without either every
    ``*.safetensors`` file when the shards numbered ``-0000i-of-0000N`` among them are the
    whole set (what ``safetensors.torch.save_file`` or torch's writer leave; a set with a shard
    missing is refused, naming it). Keys are the tensor names in the
    files (a nested target ``{"model": {...}}`` asks for ``model.<name>``: use a planner that
    renames, or load ``model.state_dict()`` itself). Every tensor is whole in one file; a
    directory of the shards torch's ``HuggingFaceStorageWriter(save_distributed=True)`` writes
    is read by :class:`TorchShardedSafetensorsReader`.

    Safetensors files have no checksums: nothing is verified beyond the headers' consistency
    and the files' sizes (see the module docstring).

    HyperParallel's reader calls and torch's work too (:mod:`.protocols`), for planners that
    drive a reader themselves::

        meta = reader.load_metadata()      # HyperParallel's Metadata: a chunk at the origin per tensor
        planner.configure_planner(state_dict, meta, rank=0)
        reader.configure_reader(meta, is_coordinator=True, rank=0)
        reader.execute_read(planner.build_local_plan(), planner)
        torch.distributed.checkpoint.load(state_dict, storage_reader=reader)  # torch's loader

    Args:
        path: the directory (a local path, or an fsspec URL such as ``s3://bucket/model``).
        thread_count: threads that read the files' headers while the coordinator builds the
            metadata (many shards on an object store); torch's name and default. The data
            is read by ``load(thread_count=)`` threads per rank.
        storage_reader: where the bytes come from, for storage options a URL cannot carry
            (e.g. ``FsspecReader(url, key=..., secret=...)``); default: local files
            (symbolic links followed, as the Hugging Face hub cache needs) or an
            :class:`~..fsspec_storage.FsspecReader` for a URL.

    Raises (from ``load``, ``load_metadata``, ``read_metadata``; each class is also the builtin
    one HyperParallel's reader raises, named after it):
        NotACheckpointError (FileNotFoundError): the directory holds neither the index nor
            ``model.safetensors`` nor other ``*.safetensors`` files; or, without the index, a
            numbered set of shards with one missing (named), two such sets, or the temporary
            file of an export not yet in place.
        SafetensorsFileMissingError (FileNotFoundError): a file the index names is missing.
        MetadataError (ValueError): the index is not JSON with a ``weight_map`` of plain file names.
        SafetensorsFormatError (ValueError): a file is truncated, or its header is damaged or lies
            about its data; a tensor the index maps to a file is not in it; two files hold the
            same tensor. The message names the file and the tensor.
        SafetensorsUnsupportedError (ValueError): a sub-byte dtype (F4, F6), or a directory of
            torch shards (the message names :class:`TorchShardedSafetensorsReader`).
        CorruptCheckpointError: a file changed while loading.
    """

    def __init__(self, path: str | os.PathLike, thread_count: int = 1, *,
                 storage_reader: StorageReader | None = None):
        self.path = checkpoint_path(path)
        self.thread_count = thread_count
        if storage_reader is not None:
            self.files = storage_reader
        elif is_url(self.path):
            self.files = FsspecReader(self.path)
        else:
            self.files = _LocalFiles(local_path(self.path))

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """torch's ``reset``: a new load, of the directory ``checkpoint_id`` when given (read as
        ``__init__`` reads a path)."""
        self._document = None
        if checkpoint_id is not None:
            self.close()
            HuggingFaceStorageReader.__init__(self, checkpoint_id, self.thread_count)
            # set up again: a subclass drops what it cached of the old directory's files
            self.set_up(getattr(self, "rank", 0), getattr(self, "is_coordinator", False))

    @property
    def bytes_read(self) -> int:  # type: ignore[override]
        """Bytes read so far through this reader (headers and index included)."""
        return self.files.bytes_read

    @property
    def memory_backed(self) -> bool:
        return self.files.memory_backed

    def set_up(self, rank: int, is_coordinator: bool) -> None:
        super().set_up(rank, is_coordinator)
        self.files.set_up(rank, is_coordinator)

    def bound_calls(self, seconds: float) -> None:
        self.files.bound_calls(seconds)

    def _where(self, name: str) -> str:
        return f"{self.path.rstrip('/')}/{name}"

    def _exists(self, name: str) -> bool:
        try:
            self.files.file_size(name)
            return True
        except (CorruptCheckpointError, FileNotFoundError):
            return False

    def weight_files(self) -> tuple[list[str], dict[str, str] | None]:
        """The files of the checkpoint, and the index's ``weight_map`` (None without an index)."""
        if not self._exists(HF_INDEX):
            if self._exists(HF_SINGLE):
                return [HF_SINGLE], None
            try:
                listed = self.files.list_files()
            except (OSError, NotImplementedError, CheckpointError):  # a storage that cannot list
                listed = []
            if listed and not any(_TORCH_SHARD_NAME.fullmatch(n) for n in listed):
                names = indexless_files(self.path, listed)
                if names:
                    for name in names:
                        validate_file_name(name, self.path)
                    return names, None
            raise NotACheckpointError(
                f"{self.path!r} is not a Hugging Face checkpoint: it has neither {HF_INDEX} nor {HF_SINGLE} nor "
                "other *.safetensors files (the shards torch's HuggingFaceStorageWriter(save_distributed=True) "
                "writes load with TorchShardedSafetensorsReader)")
        where = self._where(HF_INDEX)
        size = self.files.file_size(HF_INDEX)
        if size > MAX_INDEX_BYTES:
            raise MetadataError(f"{where} has {size} bytes, more than any index needs ({MAX_INDEX_BYTES})")
        raw = bytearray(size)
        self.files.read_into(HF_INDEX, 0, memoryview(raw))
        weight_map = parse_weight_map(raw, where)
        return sorted(set(weight_map.values())), weight_map

    def read_metadata_bytes(self) -> bytes:
        """Describe the directory as a format-v2 ``..metadata`` (coordinator only; see the module docstring)."""
        names, weight_map = self.weight_files()
        for name in names if weight_map is not None else ():
            if not self._exists(name):
                first = next(k for k, v in weight_map.items() if v == name)
                raise SafetensorsFileMissingError(
                    f"{self._where(name)} is missing: {HF_INDEX} maps {first!r} (and maybe more) to it; the "
                    "download is incomplete")
        headers = self._read_headers(names)
        entries: dict[str, md.Entry] = {}
        files = self._file_records(names, headers)
        holder: dict[str, str] = {}
        for i, (name, header) in enumerate(zip(names, headers, strict=True)):
            where = self._where(name)
            offsets = torch_saved_offsets(header, where, strict=False)  # only to tell shards apart
            if offsets is not None and any(any(o) for o in offsets.values()):
                raise SafetensorsUnsupportedError(
                    f"{where} holds shards of larger tensors (torch's HuggingFaceStorageWriter with "
                    "save_distributed=True); load the directory with TorchShardedSafetensorsReader")
            for key, t in header.tensors.items():
                if key in holder:
                    raise SafetensorsFormatError(f"tensor {key!r} is in both {self._where(holder[key])} and {where}")
                holder[key] = name
                ndim = len(t.shape)
                n = 1 if t.nbytes else 0  # one chunk: the whole tensor (an empty one has none)
                store = md.TableStore(np.zeros((n, ndim), dtype=np.int64),
                                      np.array([t.shape] * n, dtype=np.int64).reshape(n, ndim),
                                      np.full(n, i, dtype=np.int32))
                entries[key] = md.Entry(key, "tensor", (key,), t.dtype, t.shape, store=store)
        for key, name in (weight_map or {}).items():
            if holder.get(key) != name:
                found = f"it is in {self._where(holder[key])}" if key in holder else "no file holds it"
                raise SafetensorsFormatError(f"{self._where(HF_INDEX)} maps tensor {key!r} to {name}, but {found}")
        meta = md.Metadata(entries, "huggingface", 1, user={"source": "huggingface"}, files=files)
        return meta.to_json()

    def _read_headers(self, names: list[str]) -> list[SafetensorsHeader]:
        def read(name: str) -> SafetensorsHeader:
            try:
                return read_header(self.files, name, self._where(name))
            except (CorruptCheckpointError, UnsupportedValueError) as exc:
                raise _classified(exc) from None

        if self.thread_count > 1 and len(names) > 1:
            with ThreadPoolExecutor(min(self.thread_count, len(names)), thread_name_prefix="hf-header") as pool:
                return list(pool.map(read, names))
        return [read(name) for name in names]

    def _file_records(self, names: list[str], headers: list[SafetensorsHeader]) -> list[md.FileRecord]:
        # each file's "index" is its JSON header: file_index reads it again and checks its crc32c
        return [md.FileRecord(name, "", -1, HEAD, h.length, h.crc, self.files.file_size(name))
                for name, h in zip(names, headers, strict=True)]

    def file_index(self, record: md.FileRecord) -> UncheckedIndex:
        """Where each tensor of ``record``'s file starts, from its header (checked against the metadata)."""
        where = self._where(record.path)
        size = self.files.file_size(record.path)
        if size != record.size or record.index_offset + record.index_length > size:  # before allocating
            raise CorruptCheckpointError(f"{where} changed since the load read its header ({size} bytes now, "
                                         f"{record.size} then); load again")
        raw = bytearray(record.index_length)
        self.files.read_into(record.path, record.index_offset, memoryview(raw))
        if crc32c.crc32c(raw) != record.index_crc:
            raise CorruptCheckpointError(f"{where} changed since the load read its header (its header's checksum "
                                         "differs); load again")
        header = parse_header(raw, size, where)
        return UncheckedIndex({(k, 0): (t.start, t.shape, t.nbytes) for k, t in header.tensors.items()}, where)

    def file_size(self, name: str) -> int:
        return self.files.file_size(name)

    def read_into(self, name: str, offset: int, buffer: Buffer) -> None:
        self.files.read_into(name, offset, buffer)

    def list_files(self) -> list[str]:
        return self.files.list_files()

    def close(self) -> None:
        self.files.close()

    # ------------------------------------------------------------------ torch's per-item hook

    def _process_read_request(self, f: Any, req: Any, planner: Any) -> None:
        """torch's per-item step of its safetensors read loop: the region ``req`` names
        (``storage_offsets``, ``lengths``) of tensor ``req.storage_index.fqn``, read from ``f``
        (an open ``safetensors.safe_open`` file, or anything with its ``get_slice(name)[slices]``),
        copied into ``planner.resolve_tensor(req)`` and handed to ``planner.commit_tensor``.

        For code that drives this hook itself (a subclass of torch's reader, torch's tests). This
        reader's own loads (``load``, ``read_data``, ``execute_read``) do not call it: they read
        the files' byte ranges straight into the targets.

        Raises:
            CheckpointError: ``storage_offsets`` and ``lengths`` differ in length, or the
                planner's tensor has another shape than the region read.
        """
        self._commit_read(req, planner, f.get_slice(req.storage_index.fqn)[self._region_slices(req)])

    def _region_slices(self, req: Any) -> tuple[slice, ...]:
        """``req``'s region as one slice per dimension."""
        offsets, lengths = list(req.storage_offsets), list(req.lengths)
        if len(offsets) != len(lengths):
            raise CheckpointError(f"{self.path}: the read of {req.storage_index.fqn!r} has {len(offsets)} offsets "
                                  f"{offsets} but {len(lengths)} lengths {lengths}")
        return tuple(slice(int(o), int(o) + int(n)) for o, n in zip(offsets, lengths, strict=True))

    def _commit_read(self, req: Any, planner: Any, tensor: Any) -> None:
        """``tensor`` (what was read for ``req``) into the planner's tensor, then committed."""
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CheckpointError(f"{self.path}: {req.storage_index.fqn!r}: the planner's tensor for a read of "
                                  f"{list(tensor.size())} has shape {list(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)


class TorchShardedSafetensorsReader(HuggingFaceStorageReader):
    """Reads the shards torch's ``HuggingFaceStorageWriter(path, save_distributed=True)`` writes.

    Saving that way (without ``enable_consolidation``), every rank writes its shard of each
    tensor to a file of its own, ``shard-00001-model-00001-of-00001.safetensors`` and so on,
    under the tensor's own name, and records in the file's header where in the whole tensor
    the shard starts; no index is written. Pass the directory to :func:`~..api.load`::

        torch.distributed.checkpoint.save(model.state_dict(),
            storage_writer=HuggingFaceStorageWriter(d, save_distributed=True))
        load(model.state_dict(), storage_reader=TorchShardedSafetensorsReader(d))  # any mesh, any placements
        sd = load(storage_reader=TorchShardedSafetensorsReader(d))                 # full CPU tensors

    Every ``*.safetensors`` file of the directory is read, and each must record those offsets.
    A key's shards become its chunks (one per file holding part of it); they must tile the
    whole tensor exactly, and its shape is their extent (the headers record no other). Each
    rank then reads only the byte ranges its targets need, as with
    :class:`HuggingFaceStorageReader`: same arguments, same checks, no checksums to verify.

    Raises (from ``load``):
        NotACheckpointError: no such directory, or no ``*.safetensors`` file in it.
        UnsupportedValueError: the directory has a ``*.safetensors.index.json`` (whole tensors:
            use HuggingFaceStorageReader), or a file records no shard offsets.
        CorruptCheckpointError: a header is damaged; a key's shards overlap, leave a hole (a
            shard file is missing) or disagree on dtype or number of dims; a file changed while
            loading. The message names the key and the files.
    """

    def weight_files(self) -> tuple[list[str], dict[str, str] | None]:
        """The shard files (every ``*.safetensors`` of the directory, sorted), and None (no index)."""
        try:
            listed = self.files.list_files()
        except (FileNotFoundError, NotADirectoryError):
            raise NotACheckpointError(f"{self.path!r} is not a checkpoint: no such directory") from None
        except NotImplementedError:
            raise UnsupportedValueError(f"{type(self.files).__name__} cannot list {self.path!r}; "
                                        "TorchShardedSafetensorsReader finds the shard files by listing") from None
        indexes = sorted(n for n in listed if n.endswith(_INDEX_SUFFIX))
        if indexes:
            raise SafetensorsUnsupportedError(
                f"{self._where(indexes[0])}: a directory with an index holds whole tensors, not torch's shards; "
                "load it with HuggingFaceStorageReader (torch's HuggingFaceStorageWriter with "
                "enable_consolidation=True keeps its shards in the 'sharded' subdirectory)")
        names = sorted(n for n in listed if n.endswith(_SUFFIX))
        if not names:
            raise NotACheckpointError(
                f"{self.path!r} holds no *.safetensors file: torch's HuggingFaceStorageWriter(save_distributed="
                "True) writes shard-<n>-model-<i>-of-<k>.safetensors files (with enable_consolidation=True, in "
                "its 'sharded' subdirectory)")
        for name in names:
            validate_file_name(name, self.path)
        return names, None

    def read_metadata_bytes(self) -> bytes:
        """Describe the shards as a format-v2 ``..metadata`` (coordinator only): a table chunk per shard."""
        names, _ = self.weight_files()
        headers = self._read_headers(names)
        shards: dict[str, list[tuple[Box, int]]] = {}
        kinds: dict[str, tuple[str, int, int]] = {}  # key -> dtype, ndim, file of its first shard
        for i, (name, header) in enumerate(zip(names, headers, strict=True)):
            where = self._where(name)
            offsets = torch_saved_offsets(header, where)
            if offsets is None:
                raise SafetensorsUnsupportedError(
                    f"{where} records no {_TORCH_SHARDING} in its header, so it is no shard of torch's "
                    "HuggingFaceStorageWriter(save_distributed=True), and every *.safetensors file here must be "
                    "one; a Hugging Face checkpoint of whole tensors loads with HuggingFaceStorageReader")
            for key, t in header.tensors.items():
                kind = kinds.setdefault(key, (t.dtype, len(t.shape), i))
                if kind[:2] != (t.dtype, len(t.shape)):
                    raise SafetensorsFormatError(
                        f"tensor {key!r} is {t.dtype} with {len(t.shape)} dims in {where}, but {kind[0]} with "
                        f"{kind[1]} dims in {self._where(names[kind[2]])}; the files come from different saves")
                shards.setdefault(key, []).append((Box(offsets[key], t.shape), i))
        entries = {key: self._entry(key, kinds[key][0], found, names) for key, found in shards.items()}
        meta = md.Metadata(entries, "torch-sharded-safetensors", 1, user={"source": "torch-sharded-safetensors"},
                           files=self._file_records(names, headers))
        return meta.to_json()

    def _entry(self, key: str, dtype: str, shards: list[tuple[Box, int]], names: list[str]) -> md.Entry:
        """A key's table entry, after checking that its shards tile the tensor exactly."""
        ndim = shards[0][0].ndim
        shape = tuple(max(b.ends[d] for b, _ in shards) for d in range(ndim))
        live = sorted(((b, i) for b, i in shards if b.numel), key=lambda s: s[0].offsets)
        pair = first_overlap([b for b, _ in live])
        if pair is not None:
            (a, fa), (b, fb) = live[pair[0]], live[pair[1]]
            raise SafetensorsFormatError(
                f"tensor {key!r}: its shard {a} in {self._where(names[fa])} overlaps its shard {b} in "
                f"{self._where(names[fb])}; the directory mixes shards of different saves (torch's writer "
                "overwrites only its own files: save into an empty directory)")
        held, total = sum(b.numel for b, _ in live), math.prod(shape)
        if held != total:
            holes = uncovered(Box.full(shape), [b for b, _ in live]) if len(live) <= 64 else []
            hole = f"; {holes[0]} is in no file" if holes else ""
            files = sorted({names[i] for _, i in shards})
            listed = ", ".join(files[:6]) + (f" and {len(files) - 6} more" if len(files) > 6 else "")
            raise SafetensorsFormatError(
                f"tensor {key!r} (shape {list(shape)}, the extent of its shards): its shards in {listed} cover "
                f"{held} of its {total} elements{hole}. A shard file is missing from {self.path!r}"
                f"{_missing_shards(names)}, or the files come from different saves")
        n = len(live)
        store = md.TableStore(np.array([b.offsets for b, _ in live], dtype=np.int64).reshape(n, ndim),
                              np.array([b.sizes for b, _ in live], dtype=np.int64).reshape(n, ndim),
                              np.array([i for _, i in live], dtype=np.int32),
                              subs=np.zeros(n, dtype=np.int32))  # a file holds one shard of a key: its id 0
        return md.Entry(key, "tensor", (key,), dtype, shape, store=store)


def _missing_shards(names: list[str]) -> str:
    """A hint naming the shard numbers missing from torch's file names in ``names`` ("" if none)."""
    numbers = {int(m.group(1)) for m in map(_TORCH_SHARD_NAME.fullmatch, names) if m}
    absent = sorted(set(range(1, max(numbers, default=0) + 1)) - numbers)
    if not absent:
        return ""
    shown = ", ".join(f"shard-{n:05d}-*" for n in absent[:4]) + (" ..." if len(absent) > 4 else "")
    return f" (the shard numbers have holes: no {shown})"

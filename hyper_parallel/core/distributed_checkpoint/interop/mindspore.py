"""MindSpore checkpoints: read and write ``.ckpt`` and MindSpore safetensors, no MindSpore needed.

A MindSpore ``.ckpt`` is protobuf (``checkpoint.proto``): a run of ``Checkpoint`` messages,
each holding one ``Value {tag: name, tensor: TensorProto {dims, tensor_type, tensor_content}}``.
A tensor above MindSpore's slice size (512 MiB) is written as several consecutive messages of
one name whose contents concatenate, row-major. ``tensor_type`` names the dtype MindSpore's
way (``Float32``, ``BFloat16``, ``Int64``, ``Bool``...); ``str`` values (``append_dict``
strings) hold UTF-32 text with ``dims == [0]``. ``save_checkpoint(crc_check=True)`` appends
``b"crc_num"`` and the crc32 of everything before it (10 bytes, big-endian). Encrypted files
(``enc_key=``) start with a magic number and are refused: decrypt them with MindSpore first.
A MindSpore safetensors file is a plain safetensors file with ``{"format": "ms"}`` metadata and,
with ``crc_check=True``, a ``crc_num``: the crc32 over each tensor's name and bytes, in name
order.

Reading maps the file only to walk the protobuf headers, so indexing a file of any size
touches a few pages; each tensor is then ``pread`` straight into its new tensor, one at a
time, when it is written (peak memory: the largest tensor).

- :func:`read_mindspore_checkpoint`: a ``.ckpt`` or safetensors file -> ``{name: tensor}``.
- :func:`import_mindspore`: a file -> a DCP checkpoint; or a MindSpore *distributed* checkpoint
  (``rank_<id>/`` directories of sliced files plus the strategy file) -> a DCP checkpoint that
  records each slice with its saved layout, so :func:`load` reshards it onto any torch mesh.
- :func:`export_mindspore`: a DCP checkpoint -> one ``.ckpt`` or safetensors file that
  ``mindspore.load_checkpoint`` reads bit-exact (byte-identical to MindSpore's own writer).

Strategy files are ``mindspore_strategy.py``'s concern.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import re
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..backends.filesystem import FileSystemReader
from ..base import protowire as pw
from ..base.atomic_file import atomic_file
from ..base.box import Box
from ..base.errors import CheckpointError, CorruptCheckpointError, MetadataError, UnsupportedValueError
from ..engine.metadata_reader import read_checkpoint_metadata
from ..engine.streaming_writer import write_streaming
from ..format import metadata as md
from ..format.data_file import tensor_bytes
from ..format.safetensors import HEAD, METADATA_KEY, contiguous_header, encode_header, header_length, parse_header
from ..planning.planner import EntrySpec, WriteItem
from ..sharding.mindspore_strategy import MindSporeLayout, read_strategy
from ..state.flatten import prefixed_path
from ..transfer.loader import read_box

__all__ = ["read_mindspore_checkpoint", "import_mindspore", "export_mindspore", "MindSporeFile",
           "open_mindspore_file", "ExportSummary", "MS_DTYPES"]

log = logging.getLogger(__name__)

# MindSpore's tensor_type name -> our dtype name (metadata.py's names)
MS_DTYPES = {
    "Float64": "float64", "Float32": "float32", "Float16": "float16", "BFloat16": "bfloat16",
    "Int64": "int64", "Int32": "int32", "Int16": "int16", "Int8": "int8",
    "UInt64": "uint64", "UInt32": "uint32", "UInt16": "uint16", "UInt8": "uint8", "Bool": "bool",
}
_TO_MS = {v: k for k, v in MS_DTYPES.items()}
STR = "str"  # MindSpore's tensor_type for a string value
SLICE_BYTES = 512 * 1024 * 1024  # MindSpore's SLICE_SIZE (512 * 1024 KiB): bytes per message
CRC_TRAILER = b"crc_num"
_ENCRYPTED = {0x7F3A5ED8: "AES-GCM", 0x7F3A5ED9: "AES-CBC"}  # first 4 bytes, little-endian
_RANK_DIR = re.compile(r"^rank_(\d+)$")
_CRC_CHUNK = 16 << 20


# ---------------------------------------------------------------------------- reading


@dataclass
class TensorInfo:
    """One named value of a MindSpore file: our dtype name (or ``"str"``), shape, byte ranges."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: list[tuple[int, int]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(b - a for a, b in self.pieces)


class MindSporeFile:
    """An open MindSpore ``.ckpt`` or safetensors file: its index, and each value on demand.

    Use :func:`open_mindspore_file`. ``tensors`` keeps the file's order. Values are read with
    ``pread`` straight into the new tensor (one copy, no mapping kept). Close it (or use it as
    a context manager).
    """

    kind = "?"

    def __init__(self, path: str, fd: int):
        self.path = path
        self._fd = fd
        self.tensors: dict[str, TensorInfo] = {}

    def _pread_into(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < view.nbytes:
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n <= 0:
                raise CorruptCheckpointError(f"{self.path}: the file ended at byte {offset + done} while reading; "
                                             "it was truncated after it was opened")
            done += n

    def read(self, name: str) -> torch.Tensor | str:
        """The value called ``name``: a new CPU tensor, or a ``str``."""
        info = self.tensors[name]
        if info.dtype == STR:
            raw = bytearray(info.nbytes)
            pos = 0
            for a, b in info.pieces:
                self._pread_into(memoryview(raw)[pos:pos + b - a], a)
                pos += b - a
            try:
                return raw.decode("utf-32-le").rstrip("\x00")
            except UnicodeDecodeError as exc:
                raise CorruptCheckpointError(
                    f"{self.path}: the string value {name!r} is not UTF-32 text ({exc.reason} at byte {exc.start} "
                    f"of its {len(raw)}); the file is damaged") from None
        out = torch.empty(info.shape, dtype=md.torch_dtype(info.dtype))
        if out.numel():
            view = memoryview(out.reshape(-1).view(torch.uint8).numpy()).cast("B")
            pos = 0
            for a, b in info.pieces:
                self._pread_into(view[pos:pos + b - a], a)
                pos += b - a
        return out

    def digest(self, name: str) -> int:
        """crc32 of the value's bytes (to compare copies of it across files)."""
        crc = 0
        for a, b in self.tensors[name].pieces:
            crc = _crc_range(self, a, b, crc)
        return crc

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> MindSporeFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _crc_range(f: MindSporeFile, a: int, b: int, crc: int = 0) -> int:
    """crc32 of bytes ``[a, b)`` of the file, read in bounded chunks."""
    buf = memoryview(bytearray(min(_CRC_CHUNK, max(b - a, 0))))
    while a < b:
        n = min(b - a, buf.nbytes)
        f._pread_into(buf[:n], a)
        crc = zlib.crc32(buf[:n], crc)
        a += n
    return crc


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _check_dims(dims: Any, name: str, path: str) -> tuple[int, ...]:
    """The shape of a tensor of the file, refused unless our checkpoints can hold it (no
    negative dim, at most 64 dims and 2**56 elements), before anything allocates or imports it."""
    try:
        return md.check_shape(dims, f"{path}: tensor {name!r}")
    except MetadataError as exc:
        raise CorruptCheckpointError(f"{exc}; the file is damaged") from None


def _our_dtype(ms_type: str, name: str, path: str) -> str:
    if ms_type == STR:
        return STR
    try:
        return MS_DTYPES[ms_type]
    except KeyError:
        hint = " (MindSpore's packed 4-bit qint4x2 has no torch dtype)" if ms_type == "Int4" else ""
        raise UnsupportedValueError(
            f"{path}: tensor {name!r} has MindSpore dtype {ms_type!r}{hint}; this importer reads "
            f"{sorted(MS_DTYPES) + [STR]}") from None


def _name_in_cut_message(mm: Any, pos: int, end: int) -> str | None:
    """The tag of the Checkpoint.value message starting at ``pos`` when only its length is wrong."""
    try:
        _, p = pw.read_varint(mm, pos, end)
        _, p = pw.read_varint(mm, p, end)
        key, p = pw.read_varint(mm, p, end)
        n, p = pw.read_varint(mm, p, end)
        return pw.text(mm, p, p + n) if key == (1 << 3 | pw.LEN) and p + n <= end else None
    except ValueError:
        return None


class _Ckpt(MindSporeFile):
    kind = "ckpt"

    def __init__(self, path: str, fd: int, mm: mmap.mmap, verify: bool):
        super().__init__(path, fd)
        size = len(mm)
        end = size
        magic = struct.unpack("<I", mm[:4])[0] if size >= 4 else None
        if magic in _ENCRYPTED:
            raise UnsupportedValueError(
                f"{path} is an encrypted MindSpore checkpoint ({_ENCRYPTED[magic]}); decrypt it with MindSpore "
                "first: mindspore.save_checkpoint(mindspore.load_checkpoint(path, dec_key=KEY, "
                "dec_mode=MODE), 'plain.ckpt'), then import the plain file")
        if size >= 17 and mm[size - 17:size - 10] == CRC_TRAILER:
            end = size - 17
            if verify:
                stored = int.from_bytes(mm[size - 10:size], "big")
                actual = _crc_range(self, 0, end)
                if actual != stored:
                    raise CorruptCheckpointError(
                        f"{path}: crc32 of the data is {actual:#010x}, the file's crc_num trailer says "
                        f"{stored:#010x}; the file is damaged")
        if end and mm[0] != 0x0A:
            raise CorruptCheckpointError(f"{path}: not a MindSpore .ckpt (it starts with byte {mm[0]:#04x}, a "
                                         "checkpoint with 0x0a) and not a safetensors file")
        self._index(mm, end)

    def _index(self, mm: mmap.mmap, end: int) -> None:
        path = self.path
        last: str | None = None
        name: str | None = None  # of the message being read; None between messages
        try:
            for num, wire, a, b in pw.fields(mm, 0, end):
                if num != 1 or wire != pw.LEN:
                    raise pw.WireError(f"field {num} (wire type {wire}) where a Checkpoint.value is expected", a)
                name, tensor, is_map = None, None, False
                for n2, w2, x, y in pw.fields(mm, a, b):
                    if n2 == 1 and w2 == pw.LEN:
                        name = pw.text(mm, x, y)
                    elif n2 == 2 and w2 == pw.LEN:
                        tensor = (x, y)
                    elif n2 == 3:
                        is_map = True
                if name is None:
                    raise pw.WireError("a value without its tag (name)", a)
                if is_map:
                    raise UnsupportedValueError(
                        f"{path}: {name!r} is a MindSpore MapParameter (a key-value embedding table), which has "
                        "no torch counterpart; export it as tensors with MindSpore first")
                if tensor is None:
                    raise pw.WireError(f"value {name!r} holds no tensor", a)
                dims: list[int] = []
                ms_type, content = None, (b, b)  # no tensor_content: no bytes
                for n3, w3, x, y in pw.fields(mm, *tensor):
                    if n3 == 1:
                        dims.extend(pw.as_signed(v) for v in pw.repeated_varints(mm, w3, x, y))
                    elif n3 == 2 and w3 == pw.LEN:
                        ms_type = pw.text(mm, x, y)
                    elif n3 == 3 and w3 == pw.LEN:
                        content = (x, y)
                if ms_type is None:
                    raise pw.WireError(f"tensor {name!r} has no tensor_type", a)
                _check_dims(dims, name, path)
                if name == last:
                    info = self.tensors[name]
                    if (info.dtype != _our_dtype(ms_type, name, path)) or info.shape != tuple(dims):
                        raise CorruptCheckpointError(
                            f"{path}: the messages of tensor {name!r} disagree: {info.shape} vs {tuple(dims)}, "
                            f"dtype {info.dtype} vs {ms_type}")
                    info.pieces.append(content)
                    name = None
                    continue
                if name in self.tensors:
                    raise CorruptCheckpointError(
                        f"{path}: tensor {name!r} appears twice, apart (again at byte {a}); MindSpore keeps "
                        "only the last of such values: rewrite the file with unique names")
                if last is not None:
                    self._finish(last)
                self.tensors[name] = TensorInfo(name, _our_dtype(ms_type, name, path), tuple(dims), [content])
                last, name = name, None
        except pw.WireError as exc:
            # a message cut short fails on its length before its name is read: read the name anyway
            cut = name or _name_in_cut_message(mm, exc.pos, end)
            where = f" in tensor {cut!r}" if cut else f" after tensor {last!r}" if last else ""
            raise CorruptCheckpointError(
                f"{path}: truncated or not a MindSpore checkpoint{where}: {exc}") from None
        if last is not None:
            self._finish(last)

    def _finish(self, name: str) -> None:
        info = self.tensors[name]
        if info.dtype == STR:
            info.shape = ()
            return
        item = md.itemsize(info.dtype)
        have = info.nbytes
        if info.shape == (0,) and have == item:  # MindSpore reads dims [0] as a 0-d value
            info.shape = ()
        want = _numel(info.shape) * item
        if have != want:
            raise CorruptCheckpointError(
                f"{self.path}: tensor {name!r} ({info.dtype} {list(info.shape)}) needs {want} bytes, its "
                f"{len(info.pieces)} message(s) hold {have}; the file is truncated or a slice message is missing")


class _Safetensors(MindSporeFile):
    kind = "safetensors"

    def __init__(self, path: str, fd: int, mm: mmap.mmap, verify: bool):
        super().__init__(path, fd)
        n = header_length(mm[:HEAD])
        if n > len(mm) - HEAD:
            raise CorruptCheckpointError(f"{path}: safetensors header of {n} bytes runs past the file "
                                         f"({len(mm)} bytes)")
        # MindSpore's crc_num may be any JSON value: it is compared as a number below
        header = parse_header(mm[HEAD:HEAD + n], len(mm), path, string_metadata=False)
        meta = header.extra
        for name, t in header.tensors.items():
            if meta.get(name) == "Int4":
                raise UnsupportedValueError(f"{path}: tensor {name!r} is MindSpore's packed 4-bit qint4x2, which has "
                                            "no torch dtype")
            self.tensors[name] = TensorInfo(name, t.dtype, t.shape, [(t.start, t.start + t.nbytes)])
        if verify and "crc_num" in meta:
            crc = 0
            for name in sorted(self.tensors):
                crc = zlib.crc32(name.encode(), crc)
                for a, b in self.tensors[name].pieces:
                    crc = _crc_range(self, a, b, crc)
            if crc != _int_or_none(meta["crc_num"]):
                raise CorruptCheckpointError(f"{path}: crc32 of the tensors is {crc}, the file's crc_num says "
                                             f"{meta['crc_num']}; the file is damaged")


def _int_or_none(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(float("inf"))
        return None


def open_mindspore_file(path: str | os.PathLike, *, verify: bool = True) -> MindSporeFile:
    """Open a MindSpore ``.ckpt`` or safetensors file (told apart by content) and index it.

    Args:
        verify: check the crc the file carries, if any (``.ckpt`` trailer, safetensors
            ``crc_num``); reads the file once.

    Raises:
        UnsupportedValueError: an encrypted file, an unknown dtype, a MapParameter.
        CorruptCheckpointError: a truncated or damaged file, a bad crc, messages of one
            tensor that do not add up to it.
    """
    where = os.fspath(path)
    size = os.path.getsize(where)
    if size == 0:
        raise CorruptCheckpointError(f"{where}: empty file; expected a MindSpore .ckpt or safetensors file")
    fd = os.open(where, os.O_RDONLY)
    try:
        # the index is walked on a mapping (only header pages are touched); data is pread later
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
            if size >= 9 and mm[8] == ord("{") and header_length(mm[:HEAD]) < size:
                return _Safetensors(where, fd, mm, verify)
            return _Ckpt(where, fd, mm, verify)
    except BaseException:
        os.close(fd)
        raise


def read_mindspore_checkpoint(path: str | os.PathLike, *, verify: bool = True) -> dict[str, torch.Tensor | str]:
    """Every value of a MindSpore ``.ckpt`` or safetensors file: ``{name: tensor or str}``.

    Holds the whole file in memory; :func:`import_mindspore` streams instead.

    Example::

        sd = read_mindspore_checkpoint("lenet.ckpt")
        sd["fc1.weight"].dtype     # torch.float32
    """
    with open_mindspore_file(path, verify=verify) as f:
        return {name: f.read(name) for name in f.tensors}


# ---------------------------------------------------------------------------- import


def _rank_files(src: str) -> dict[int, str]:
    """``{rank: file}`` of a MindSpore distributed checkpoint directory (``rank_<id>/*.ckpt``)."""
    out: dict[int, str] = {}
    for d in os.listdir(src):
        m = _RANK_DIR.match(d)
        full = os.path.join(src, d)
        if not m or not os.path.isdir(full):
            continue
        names = sorted(os.listdir(full))
        ckpts = [n for n in names if n.endswith(".ckpt")]
        sts = [n for n in names if n.endswith(".safetensors")]
        if ckpts and sts:
            raise CheckpointError(f"{full} holds both .ckpt and .safetensors files; keep one kind")
        chosen = (ckpts or sts)[-1:]  # as MindSpore's tools: the last in name order
        if chosen:
            if len(ckpts or sts) > 1:
                log.warning("%s holds %d checkpoint files; using %s (the last in name order, as MindSpore does)",
                            full, len(ckpts or sts), chosen[0])
            out[int(m.group(1))] = os.path.join(full, chosen[0])
    return dict(sorted(out.items()))


def import_mindspore(
    src: str | os.PathLike,
    dst_path: str | os.PathLike,
    *,
    strategy: str | os.PathLike | None = None,
    prefix: str = "",
    verify: bool = True,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
) -> md.Metadata:
    """Convert a MindSpore checkpoint into a DCP checkpoint, streaming one tensor at a time.

    Two sources:

    - a ``.ckpt`` or MindSpore safetensors file: every tensor whole (string values become
      ``str`` values);
    - a MindSpore distributed checkpoint: a directory of ``rank_<id>/`` sub-directories,
      each with that rank's sliced file, plus ``strategy`` (the strategy file the job saved,
      protobuf or JSON). Each distinct slice is written once, as a chunk of its global tensor
      with the layout the strategy gives it, so :func:`load` reshards it onto any torch mesh.
      Parameters the strategy does not name (``global_step``, ``learning_rate``) are taken as
      replicated, after checking every rank holds the same bytes. Parameters it names that no
      rank file holds are an error when a slice of theirs lies only on ranks without a file, and
      otherwise (not saved, e.g. optimizer states) skipped with a warning, as MindSpore does.

    Args:
        src: the file, or the distributed checkpoint directory.
        dst_path: a new directory for the DCP checkpoint.
        strategy: the strategy file; required for (and only for) a directory.
        prefix: prepended to every name (``"model."`` to match ``{"model": model.state_dict()}``).
        verify: check the crc the files carry (and that replicated copies agree).
        progress: called with a byte count as each tensor is written.

    Raises:
        UnsupportedValueError: an encrypted file, an unknown dtype, optimizer-parallel slicing.
        CorruptCheckpointError: a truncated or damaged file, a bad crc.
        CheckpointError: slices that do not cover a tensor, or disagree with the strategy or
            with each other, or strategy parameters lost with missing rank files (the message
            names the file, the tensor and what was expected).

    Example::

        import_mindspore("ms_ckpt_dir", "dcp_ckpt", strategy="ms_ckpt_dir/strategy.ckpt")
        load(sd, checkpoint_id="dcp_ckpt")      # any torch mesh
    """
    src = os.fspath(src)
    if os.path.isdir(src):
        ranks = _rank_files(src)
        if not ranks:
            raise CheckpointError(f"{src} is a directory without rank_<id>/ sub-directories of .ckpt or "
                                  ".safetensors files; pass a checkpoint file, or a MindSpore distributed "
                                  "checkpoint directory")
        if strategy is None:
            raise ValueError(f"{src} is a MindSpore distributed checkpoint ({len(ranks)} rank directories); "
                             "pass its strategy file (strategy=..., CLI --strategy FILE): the slices alone "
                             "do not say where they belong")
        return _import_distributed(src, ranks, os.fspath(strategy), dst_path, prefix, verify, overwrite, progress)
    if strategy is not None:
        raise ValueError(f"{src} is a single file; a strategy file goes with a distributed checkpoint directory "
                         "(rank_<id>/ sub-directories)")
    with open_mindspore_file(src, verify=verify) as f:
        entries: dict[str, EntrySpec] = {}
        items: list[WriteItem] = []
        names: dict[str, str] = {}
        for name, info in f.tensors.items():
            key = prefix + name
            names[key] = name
            if info.dtype == STR:
                entries[key] = EntrySpec("object", prefixed_path(prefix, name))
                continue
            entries[key] = EntrySpec("tensor", prefixed_path(prefix, name), info.dtype, info.shape)
            if info.nbytes:
                items.append(WriteItem(key, Box.full(info.shape), info.nbytes))

        def produce(item: WriteItem) -> Any:
            value = f.read(names[item.key])
            if progress is not None and item.nbytes:
                progress(item.nbytes)
            return value

        return write_streaming(dst_path, entries, [items], produce, overwrite=overwrite,
                               user_metadata={"imported_from": {"platform": "mindspore", "format": f.kind}})


def _import_distributed(src: str, ranks: dict[int, str], strategy_file: str, dst_path: str | os.PathLike,
                        prefix: str, verify: bool, overwrite: bool,
                        progress: Callable[[int], None] | None) -> md.Metadata:
    layouts = read_strategy(strategy_file)
    files: dict[int, MindSporeFile] = {}
    try:
        for r, p in ranks.items():
            files[r] = open_mindspore_file(p, verify=verify)
        order: dict[str, None] = {}
        for f in files.values():
            order.update(dict.fromkeys(f.tensors))
        entries: dict[str, EntrySpec] = {}
        by_rank: dict[int, list[WriteItem]] = {}
        source: dict[tuple[str, Box], tuple[int, str]] = {}
        for name in order:
            key = prefix + name
            have = [r for r in files if name in files[r].tensors]
            first = files[have[0]].tensors[name]
            for r in have[1:]:
                other = files[r].tensors[name]
                if other.dtype != first.dtype:
                    raise CheckpointError(f"{name!r} is {first.dtype} in {files[have[0]].path} but {other.dtype} in "
                                          f"{files[r].path}")
            path = prefixed_path(prefix, name)
            if first.dtype == STR:
                entries[key] = EntrySpec("object", path)
                source[(key, Box((), ()))] = (have[0], name)
                continue
            if name in layouts:
                spec, placed = _sliced(name, layouts[name], files, have, strategy_file)
                entries[key] = EntrySpec("tensor", path, first.dtype, spec[0], spec[1])
            else:
                _check_replicated(name, files, have, verify)
                entries[key] = EntrySpec("tensor", path, first.dtype, first.shape)
                placed = [(Box.full(first.shape), have[0])]
            for box, r in placed:
                nbytes = box.numel * md.itemsize(first.dtype)
                if nbytes:
                    by_rank.setdefault(r, []).append(WriteItem(key, box, nbytes))
                    source[(key, box)] = (r, name)
        _check_unsaved(src, layouts, order, files, strategy_file)  # after the saved ones' own errors

        def produce(item: WriteItem) -> Any:
            r, name = source[(item.key, item.box)]
            value = files[r].read(name)
            if progress is not None and item.nbytes:
                progress(item.nbytes)
            return value

        return write_streaming(
            dst_path, entries, [by_rank[r] for r in sorted(by_rank)], produce, overwrite=overwrite,
            user_metadata={"imported_from": {"platform": "mindspore", "format": "distributed",
                                             "ranks": len(files), "strategy": os.path.basename(strategy_file)}})
    finally:
        for f in files.values():
            f.close()


def _check_unsaved(src: str, layouts: dict[str, MindSporeLayout], saved: dict[str, None],
                   files: dict[int, MindSporeFile], strategy_file: str) -> None:
    """Refuse strategy parameters that no rank file holds because their ranks' files are missing.

    A parameter the strategy names may legitimately be in no file: the strategy of a training
    job names every parameter of the compiled graph, optimizer states included, while a
    checkpoint of the network alone does not hold those (MindSpore's ``transform_checkpoints``
    then ignores them). So it is skipped, with a warning, when each of its slices has a rank
    with a file (that rank would hold it had it been saved). When some slice lies only on ranks
    without a file (a whole pipeline stage's ``rank_<id>/`` missing), the parameter is lost with
    them: an error, as MindSpore's ``transform_checkpoints`` refuses missing rank files.
    """
    lost: dict[tuple[int, ...], list[str]] = {}
    unsaved: list[str] = []
    for name, ms_layout in layouts.items():
        if name in saved:
            continue
        missing = tuple(r for ranks in _slice_holders(ms_layout) if not any(r in files for r in ranks)
                        for r in ranks)
        if missing:
            lost.setdefault(missing, []).append(name)
        else:
            unsaved.append(name)
    if lost:
        detail = "; ".join(f"{names} on rank(s) {list(missing)}" for missing, names in lost.items())
        raise CheckpointError(
            f"{src}: {strategy_file} names parameter(s) that no rank file holds, and the ranks it gives them "
            f"have no rank_<id>/ file: {detail}. Rank files found: {sorted(files)}. Is a pipeline stage's "
            "rank_<id>/ directory missing?")
    if unsaved:
        log.warning("%s names %d parameter(s) that no rank file of %s holds although ranks holding their slices "
                    "have files (e.g. optimizer states of a network-only checkpoint); they are not imported: %s",
                    strategy_file, len(unsaved), src, ", ".join(unsaved[:20]))


def _slice_holders(ms_layout: MindSporeLayout) -> list[list[int]]:
    """The global ranks of each distinct slice of a parameter (replicas share one), shape unknown.

    Ranks hold the same slice when their device-matrix coordinates agree on every dim the
    tensor_map splits by (dims counted from the right), which needs no tensor shape.
    """
    dev = ms_layout.dev_matrix
    used = sorted({x for t in ms_layout.tensor_map for x in t if 0 <= x < len(dev)})
    world = math.prod(dev)
    groups: dict[tuple[int, ...], list[int]] = {}
    for pos in range(world):
        coord, rest = [], pos  # coord[i]: the coordinate on dev dim i counted from the right
        for size in reversed(dev):
            coord.append(rest % size)
            rest //= size
        groups.setdefault(tuple(coord[d] for d in used), []).append(ms_layout.stage * world + pos)
    return list(groups.values())


def _local_shape(name: str, ms_layout: MindSporeLayout, files: dict[int, MindSporeFile], have: list[int],
                 strategy_file: str) -> tuple[tuple[int, ...], int]:
    """The slice shape of ``name`` most of its rank files agree on, and a rank holding it.

    MindSpore slices evenly, so every rank's slice has one shape. Taking the shape most files
    hold (rather than the first file's) lets the error name the file that disagrees; when no
    shape has a majority, the error lists every file with its shape.
    """
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for r in have:
        by_shape.setdefault(files[r].tensors[name].shape, []).append(r)
    if len(by_shape) == 1:
        return next(iter(by_shape)), have[0]
    groups = sorted(by_shape.items(), key=lambda kv: -len(kv[1]))
    where = (f"{strategy_file} (dev_matrix {list(ms_layout.dev_matrix)}, tensor_map {ms_layout.resolved_map()}) "
             "slices it evenly, so every rank's slice has one shape")
    if len(groups[0][1]) > len(groups[1][1]):
        shape, ranks = groups[0]
        odd = "; ".join(f"{files[r].path} holds {list(s)}" for s, rs in groups[1:] for r in rs)
        raise CheckpointError(
            f"{name!r}: {odd}, but the other {len(ranks)} rank file(s) (ranks {ranks}) hold {list(shape)} and "
            f"{where}; is it from another checkpoint?")
    listed = "; ".join(f"{list(s)} in {', '.join(files[r].path for r in rs)}" for s, rs in groups)
    raise CheckpointError(f"{name!r}: its rank files hold slices of different shapes and no shape is held by most "
                          f"of them: {listed}. {where}; one of these files is from another checkpoint")


def _sliced(name: str, ms_layout: MindSporeLayout, files: dict[int, MindSporeFile], have: list[int],
            strategy_file: str) -> tuple[tuple[tuple[int, ...], dict[str, Any]], list[tuple[Box, int]]]:
    """Global shape and layout record of a sliced parameter, and which rank's file gives each distinct box."""
    local, holder = _local_shape(name, ms_layout, files, have, strategy_file)
    try:
        tl = ms_layout.tensor_layout(ndim=len(local))
    except ValueError as exc:
        raise CheckpointError(f"{strategy_file}: parameter {name!r} (shape {list(local)} in "
                              f"{files[holder].path}): {exc}") from None
    global_shape = tuple(s * math.prod(tl.layout.mesh_shape[m] for m in tl.splits.get(d, ()))
                         for d, s in enumerate(local))
    placed: list[tuple[Box, int]] = []
    for box, holders in tl.holders(global_shape).items():
        present = [r for r in holders if r in files and name in files[r].tensors]
        if not present:
            raise CheckpointError(
                f"{name!r}: no rank file holds its slice at offsets {list(box.offsets)} (sizes {list(box.sizes)}), "
                f"which the strategy gives to rank(s) {holders}; rank files found: {sorted(files)}. The slice "
                "set does not cover the tensor")
        r = present[0]
        got = files[r].tensors[name].shape
        if got != box.sizes:
            raise CheckpointError(
                f"{files[r].path}: {name!r} has shape {list(got)}, but {strategy_file} (dev_matrix "
                f"{list(ms_layout.dev_matrix)}, tensor_map {ms_layout.resolved_map(len(local))}) gives rank {r} "
                f"a slice of {list(box.sizes)} of the global {list(global_shape)}")
        placed.append((box, r))
    return (global_shape, tl.to_record()), placed


def _check_replicated(name: str, files: dict[int, MindSporeFile], have: list[int], verify: bool) -> None:
    first = files[have[0]]
    for r in have[1:]:
        f = files[r]
        if f.tensors[name].shape != first.tensors[name].shape or (verify and f.digest(name) != first.digest(name)):
            raise CheckpointError(
                f"{name!r} is not in the strategy file, so it should be the same on every rank, but "
                f"{first.path} and {f.path} hold different values (shapes {list(first.tensors[name].shape)} "
                f"and {list(f.tensors[name].shape)}); is it the strategy file of this checkpoint?")


# ---------------------------------------------------------------------------- export


@dataclass
class ExportSummary:
    """What :func:`export_mindspore` wrote."""

    path: str
    format: str
    tensors: int = 0
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)  # keys with no MindSpore counterpart
    seconds: float = 0.0


def _ckpt_message(name: str, ms_type: str, dims: list[int], n: int) -> bytes:
    """The protobuf bytes of one ``Checkpoint`` message up to its ``n`` content bytes, which follow."""
    tensor = pw.repeated_ints(1, dims) + pw.str_field(2, ms_type) + pw.len_header(3, n)
    value = pw.str_field(1, name) + pw.len_header(2, len(tensor) + n)
    return pw.len_header(1, len(value) + len(tensor) + n) + value + tensor


def _plain_value(v: Any) -> tuple[str, torch.Tensor | str] | None:
    """A JSON value as MindSpore holds such things (``append_dict``): str, or a 0-d tensor."""
    if isinstance(v, str):
        return STR, v
    if isinstance(v, bool):
        return "bool", torch.tensor(v)
    if isinstance(v, int) and -(1 << 63) <= v < 1 << 63:
        return "int64", torch.tensor(v, dtype=torch.int64)
    if isinstance(v, float):
        return "float64", torch.tensor(v, dtype=torch.float64)
    return None


def export_mindspore(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    format: str | None = None,
    prefix: str = "",
    crc: bool = False,
    verify: bool = True,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
) -> ExportSummary:
    """Write a DCP checkpoint as one MindSpore ``.ckpt`` (or safetensors) file, whole tensors.

    The file is what ``mindspore.save_checkpoint`` writes for the same tensors, byte for byte
    (tensors above 512 MiB in several messages), so ``mindspore.load_checkpoint`` reads it
    bit-exact. It streams: one tensor in memory at a time. Plain values become what MindSpore
    keeps in ``append_dict``: strings stay strings (``.ckpt`` only), ints/floats/bools become
    0-d Int64/Float64/Bool tensors; other values (bytes, lists, dicts, None) are skipped and
    listed in the summary.

    Args:
        src: a DCP checkpoint directory.
        dst: the file to write (written to a temporary name, then renamed).
        format: ``"ckpt"`` or ``"safetensors"``; by default from ``dst``'s extension.
        prefix: export only keys starting with it, with it removed (e.g. ``"model."``).
        crc: add MindSpore's crc (the ``.ckpt`` ``crc_num`` trailer, or safetensors
            ``crc_num`` metadata) so ``load_checkpoint(..., crc_check=True)`` verifies it.
        verify: check our checksums while reading.
        progress: called with each tensor's byte count once written.

    Raises:
        UnsupportedValueError: a tensor's dtype has no MindSpore name (float8, complex).
        CheckpointError: ``dst`` exists (without ``overwrite``) or nothing matches ``prefix``.

    Example::

        export_mindspore("dcp_ckpt", "model.ckpt", prefix="model.")
        # in MindSpore: mindspore.load_checkpoint("model.ckpt")
    """
    t0 = time.perf_counter()
    dst = os.fspath(dst)
    fmt = format or ("safetensors" if dst.endswith(".safetensors") else "ckpt")
    if fmt not in ("ckpt", "safetensors"):
        raise ValueError(f"format must be 'ckpt' or 'safetensors', found {format!r}")
    if os.path.exists(dst) and not overwrite:
        raise CheckpointError(f"{dst!r} already exists; pass overwrite=True to replace it")
    reader = FileSystemReader(src)
    try:
        meta = read_checkpoint_metadata(reader)
        summary = ExportSummary(dst, fmt)
        plan: list[tuple[str, str, tuple[int, ...], md.Entry | None, Any]] = []  # name, dtype, shape, entry, value
        for key, e in meta.entries.items():
            if not key.startswith(prefix):
                continue
            name = key[len(prefix):]
            if e.kind in ("tensor", "ndarray"):
                if e.dtype not in _TO_MS:
                    raise UnsupportedValueError(
                        f"{key!r} has dtype {e.dtype}, which MindSpore has no name for; MindSpore reads "
                        f"{sorted(_TO_MS)}: convert it first")
                plan.append((name, e.dtype, tuple(e.shape or ()), e, None))
                continue
            plain = _plain_value(e.value) if e.kind == "object" else None
            if plain is None or (plain[0] == STR and fmt == "safetensors"):
                summary.skipped.append(key)
                continue
            shape = () if plain[0] == STR else tuple(plain[1].shape)  # type: ignore[union-attr]
            plan.append((name, plain[0], shape, None, plain[1]))
        if not plan:
            raise CheckpointError(f"{os.fspath(src)!r}: no tensors to export (prefix {prefix!r})")
        if summary.skipped:
            log.warning("export_mindspore: %d value(s) have no MindSpore counterpart and were skipped: %s",
                        len(summary.skipped), ", ".join(summary.skipped[:20]))

        def data(entry: md.Entry | None, value: Any) -> memoryview:
            if entry is None:
                if isinstance(value, str):
                    return memoryview(np.array(value).tobytes())
                return tensor_bytes(value)
            return tensor_bytes(read_box(entry, reader, verify=verify)[0])

        if fmt != "ckpt" and any(p[0] == METADATA_KEY for p in plan):  # .ckpt files may hold the name
            raise UnsupportedValueError(
                f"{dst}: a tensor is named '__metadata__', which safetensors reserves for its header's metadata; "
                "export as .ckpt (format='ckpt'), or rename the tensor first")
        os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
        with atomic_file(dst, sync_dir=False) as out:
            if fmt == "ckpt":
                _write_ckpt(out, plan, data, crc, summary, progress)
            else:
                _write_safetensors(out, plan, data, crc, summary, progress)
    finally:
        reader.close()
    summary.seconds = time.perf_counter() - t0
    return summary


def _write_ckpt(out: Any, plan: list, data: Callable, crc_on: bool, summary: ExportSummary,
                progress: Callable[[int], None] | None) -> None:
    crc = 0

    def write(b: Any) -> None:
        nonlocal crc
        out.write(b)
        if crc_on:
            crc = zlib.crc32(b, crc)

    for name, dtype, shape, entry, value in plan:
        raw = data(entry, value)
        ms_type = STR if dtype == STR else _TO_MS[dtype]
        dims = [0] if dtype == STR else list(shape)
        for off in range(0, max(raw.nbytes, 1), SLICE_BYTES):  # an empty tensor still gets its message
            piece = raw[off:off + SLICE_BYTES]
            write(_ckpt_message(name, ms_type, dims, piece.nbytes))
            write(piece)
        summary.tensors += 1
        summary.bytes += raw.nbytes
        if progress is not None:
            progress(raw.nbytes)
        del raw, piece  # free this tensor before reading the next: one tensor in memory
    if crc_on:
        out.write(CRC_TRAILER + crc.to_bytes(10, "big"))


def _write_safetensors(out: Any, plan: list, data: Callable, crc_on: bool, summary: ExportSummary,
                       progress: Callable[[int], None] | None) -> None:
    # MindSpore writes names in sorted order and checksums them in that order; the crc is
    # only known at the end, so the header reserves ten digits (int() reads leading zeros).
    plan = sorted(plan, key=lambda p: p[0])
    header = contiguous_header([(name, dtype, shape) for name, dtype, shape, _, _ in plan],
                               {"format": "ms", **({"crc_num": "0" * 10} if crc_on else {})})
    head = encode_header(header)
    out.write(head)
    crc = 0
    for name, _, _, entry, value in plan:
        raw = data(entry, value)
        out.write(raw)
        if crc_on:
            crc = zlib.crc32(raw, zlib.crc32(name.encode(), crc))
        summary.tensors += 1
        summary.bytes += raw.nbytes
        if progress is not None:
            progress(raw.nbytes)
        del raw
    if crc_on:
        header[METADATA_KEY]["crc_num"] = f"{crc:010d}"
        final = encode_header(header)
        assert len(final) == len(head)
        out.seek(0)
        out.write(final)

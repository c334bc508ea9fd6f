"""FP8 block-quantized Hugging Face checkpoints, dequantized while they load.

DeepSeek-V3-style checkpoints store a linear weight ``<name>.weight`` as float8 (``F8_E4M3``)
beside ``<name>.weight_scale_inv``: one float32 factor per ``block_size x block_size`` block
of the weight, a grid of ``ceil(rows / block) x ceil(cols / block)``. The real value of
element ``(i, j)`` is ``float32(weight[i, j]) * scale_inv[i // block, j // block]``, rounded
once to float32 and then to ``target_dtype`` (torch's ``QuantizedHuggingFaceStorageReader``
computes exactly this, so both give the same bits).

How it fits the loader: :class:`QuantizedHuggingFaceStorageReader` is a
:class:`~.reader.HuggingFaceStorageReader` whose metadata presents each quantized weight
as a tensor of ``target_dtype`` held whole in a *virtual file* of its own
(``dequantized-<n>-<name>``: the n-th quantized weight in name order). The loader plans and
reads that file like any other; a read of virtual bytes ``[a, b)`` (elements ``a / itemsize``
on, row-major) reads the same elements' float8 bytes from the real file and the scale-grid
cells of their blocks, and writes dequantized values into the loader's buffer. So a rank
reads only the rows (or the parts of rows) its targets need and the scale cells of the
blocks they touch; blocks that straddle a shard boundary are simply read by both ranks' ranges.
Nothing larger than one read of the loader (32 MiB) is ever materialised.

Every rank finds the quantized pairs itself (from ``model.safetensors.index.json``, or the
one file's header), since only the coordinator reads the metadata. Scale tensors stay keys
of the checkpoint (as in torch): a target may ask for them and gets them raw.

torch's per-item hook ``_process_read_request(f, item, planner)`` (which torch's read loop
calls with an open ``safetensors.safe_open`` file) is here too, for code that drives it itself;
it dequantizes through the same arithmetic (:func:`dequantize_region`).

Not here: MXFP4 (``*_blocks``/``*_scales``, gpt-oss), refused with a clear error.
"""

from __future__ import annotations

import numbers
import os
import re
import threading
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np
import torch

from ...backends.locations import is_url, local_path
from ...backends.protocol import Buffer, StorageReader
from ...base.dtypes import dtype_name, itemsize, torch_dtype
from ...base.errors import CheckpointError, CorruptCheckpointError, UnsupportedValueError
from ...format import metadata as md
from ...format.data_file import UncheckedIndex
from ...format.safetensors import SafetensorsHeader, SafetensorsTensor, read_header, read_header_bytes
from ...format.validation import validate_file_name
from .index import HF_SINGLE
from .reader import HuggingFaceStorageReader

SCALE_SUFFIX = "_scale_inv"  # <name>.weight -> <name>.weight_scale_inv
VIRTUAL_PREFIX = "dequantized-"
_WEIGHT_DTYPES = ("float8_e4m3fn", "float8_e5m2")
_SCALE_DTYPES = ("float32", "bfloat16", "float16")
_FLOAT8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]|\.{2,}")


@dataclass(frozen=True)
class QuantizedWeight:
    """One quantized weight: where its float8 bytes and its scale grid lie."""

    key: str
    scale_key: str
    file: str  # the weight's file
    start: int  # absolute offset of its bytes
    rows: int
    cols: int
    dtype: str  # float8 dtype
    scale_file: str
    scale_start: int
    scale_cols: int  # ceil(cols / block)
    scale_dtype: str
    header_crc: int  # crc32c of the weight file's header this was built from


def virtual_name(n: int, key: str) -> str:
    """The virtual file of the n-th quantized weight (a plain file name, as metadata needs)."""
    return f"{VIRTUAL_PREFIX}{n:06d}-{_UNSAFE.sub('_', key)}"[:200]


class QuantizedHuggingFaceStorageReader(HuggingFaceStorageReader):
    """Reads an FP8 block-quantized Hugging Face checkpoint, dequantizing as it loads.

    torch's ``QuantizedHuggingFaceStorageReader`` with the same arguments: every
    ``<name>.weight`` that has a ``<name>.weight_scale_inv`` is loaded as
    ``float32(weight) * scale_inv[block]`` in ``target_dtype`` (then converted to the
    target's dtype); every other tensor loads as with :class:`HuggingFaceStorageReader`.
    Targets may be plain tensors or DTensors of any placements; each rank reads only the
    float8 bytes and scale cells of its part::

        load(model.state_dict(), storage_reader=QuantizedHuggingFaceStorageReader(
            "/models/DeepSeek-V3", target_dtype=torch.bfloat16))

    Args:
        path: the directory (local, or an fsspec URL).
        thread_count: as for :class:`HuggingFaceStorageReader`.
        target_dtype: the floating dtype dequantized values are rounded to (torch's default,
            float32). A quantized weight's metadata dtype is this one.
        block_size: rows and columns of a scale block (DeepSeek-V3: 128, its config's
            ``weight_block_size``): an int from 1 to ``2**63 - 1``. A block may be larger
            than a weight (its grid is then 1 x 1), as in torch; memory follows the bytes
            read, never the block size. One larger than both a weight's dimensions and
            ``2**31 - 1`` (e.g. ``1 << 40``) is a mistake, refused at load.
        storage_reader: as for :class:`HuggingFaceStorageReader`.

    Raises:
        ValueError: ``block_size`` is not an int from 1 to ``2**63 - 1`` (bools refused), or
            ``target_dtype`` is not a floating dtype; at construction, before any read.

    Raises (from ``load``), besides :class:`HuggingFaceStorageReader`'s, naming the key and file:
        ValueError: ``block_size`` above ``2**31 - 1`` and both dimensions of a quantized
            weight, before anything it would size is read or allocated.
        UnsupportedValueError: a weight with a scale is not 2-D float8 (e4m3fn, e5m2) or its
            scale is not float32/bfloat16/float16; a float8 tensor has no scale; an MXFP4
            tensor (``*_blocks`` with ``*_scales``).
        CorruptCheckpointError: a scale grid's shape is not ``ceil(rows / block_size) x
            ceil(cols / block_size)``; a file changed or ends early while loading.
    """

    def __init__(self, path: str | os.PathLike, thread_count: int = 1, target_dtype: torch.dtype = torch.float32,
                 block_size: int = 128, *, storage_reader: StorageReader | None = None):
        super().__init__(path, thread_count, storage_reader=storage_reader)
        if not isinstance(target_dtype, torch.dtype) or not target_dtype.is_floating_point:
            raise ValueError(f"target_dtype must be a floating torch dtype, found {target_dtype!r}")
        dtype_name(target_dtype)  # one the format knows
        self.target_dtype = target_dtype
        self.block_size = _checked_block_size(block_size)
        self._lock = threading.RLock()
        self._reset()

    def _reset(self) -> None:
        self._headers: dict[str, SafetensorsHeader] = {}
        self._pairs: list[tuple[str, str]] | None = None  # (weight, scale), by weight name; None: not read yet
        # torch's names, which its reader's per-item hook (_process_read_request) reads and code
        # written for torch's reader may set: tensor -> file, weight -> scale (both filled when
        # the files are read), weight -> full shape (filled by no one here; the file's otherwise)
        self._weight_map: dict[str, str] = {}
        self._weight_scale_mapping: dict[str, str] = {}
        self._tensor_full_shapes: dict[str, torch.Size] = {}
        self._names: dict[str, int] = {}  # virtual file -> pair number
        self._weights: dict[int, QuantizedWeight] = {}

    def set_up(self, rank: int, is_coordinator: bool) -> None:
        with self._lock:
            self._reset()  # files may have changed since an earlier load
        super().set_up(rank, is_coordinator)

    # ------------------------------------------------------------------ which tensors

    def _read_headers(self, names: list[str]) -> list[SafetensorsHeader]:
        headers = super()._read_headers(names)
        with self._lock:
            self._headers.update(zip(names, headers, strict=True))
        return headers

    def _header(self, name: str) -> SafetensorsHeader:
        with self._lock:
            found = self._headers.get(name)
        if found is None:
            found = read_header(self.files, name, self._where(name))
            with self._lock:
                self._headers[name] = found
        return found

    def _tensor_files(self) -> dict[str, str]:
        """Every tensor's file: the index's ``weight_map``, or the single file's header."""
        with self._lock:
            if self._pairs is None:
                names, weight_map = self.weight_files()
                if weight_map is None:
                    weight_map = dict.fromkeys(self._header(names[0]).tensors, HF_SINGLE)
                self._weight_map = weight_map
                self._pairs = sorted((k, k + SCALE_SUFFIX) for k in weight_map
                                     if k.endswith(".weight") and k + SCALE_SUFFIX in weight_map)
                self._weight_scale_mapping = dict(self._pairs)
                self._names = {virtual_name(n, w): n for n, (w, _) in enumerate(self._pairs)}
            return self._weight_map

    def _tensor(self, key: str) -> tuple[str, SafetensorsTensor]:
        name = self._tensor_files()[key]
        t = self._header(name).tensors.get(key)
        if t is None:
            raise CorruptCheckpointError(f"{self._where(name)} does not hold tensor {key!r}, which the index "
                                         "places there")
        return name, t

    def _weight(self, n: int) -> QuantizedWeight:
        """The n-th quantized weight, its pair checked (shapes, dtypes)."""
        with self._lock:
            found = self._weights.get(n)
            if found is not None:
                return found
            self._tensor_files()
            key, scale_key = self._pairs[n]
            wfile, w = self._tensor(key)
            sfile, s = self._tensor(scale_key)
            where, swhere = self._where(wfile), self._where(sfile)
            if w.dtype not in _WEIGHT_DTYPES or len(w.shape) != 2:
                raise UnsupportedValueError(
                    f"{where}: tensor {key!r} is {w.dtype} of shape {list(w.shape)}, but {scale_key!r} in {swhere} "
                    f"marks it as block-quantized: expected a 2-D {' or '.join(_WEIGHT_DTYPES)} weight")
            if s.dtype not in _SCALE_DTYPES:
                raise UnsupportedValueError(
                    f"{swhere}: scale {scale_key!r} of {key!r} is {s.dtype}; expected {', '.join(_SCALE_DTYPES)}")
            rows, cols = w.shape
            b = self.block_size
            grid = (-(-rows // b), -(-cols // b))
            if tuple(s.shape) != grid:  # checked before any read or allocation it would size
                raise CorruptCheckpointError(
                    f"{swhere}: scale {scale_key!r} has shape {list(s.shape)}, but weight {key!r} of shape "
                    f"[{rows}, {cols}] in {where} with block_size={b} needs [{grid[0]}, {grid[1]}] "
                    f"(ceil(rows / block) x ceil(cols / block)); {_fitting_blocks((rows, cols), s.shape)}")
            if b > _MAX_USEFUL_BLOCK and b > max(rows, cols):  # before any read or allocation it would size
                raise ValueError(
                    f"block_size={b} is far larger than weight {key!r} of shape [{rows}, {cols}] in {where}: no "
                    f"checkpoint blocks a weight by more than {_MAX_USEFUL_BLOCK} (2**31 - 1) rows or columns; pass "
                    "the checkpoint's block size (its config's weight_block_size, 128 for DeepSeek-V3)")
            found = self._weights[n] = QuantizedWeight(
                key, scale_key, wfile, w.start, rows, cols, w.dtype, sfile, s.start, grid[1], s.dtype,
                self._header(wfile).crc)
            return found

    def _virtual(self, name: str) -> QuantizedWeight | None:
        """The quantized weight a virtual file name stands for; None for a real file."""
        if not name.startswith(VIRTUAL_PREFIX):
            return None
        self._tensor_files()
        n = self._names.get(name)
        return self._weight(n) if n is not None else None

    # ------------------------------------------------------------------ metadata

    def read_metadata_bytes(self) -> bytes:
        """The plain reader's metadata, each quantized weight moved into its virtual file as
        a ``target_dtype`` tensor (coordinator only)."""
        meta = md.Metadata.from_json(super().read_metadata_bytes(), where=self._where(".metadata"))
        holder = self._tensor_files()
        scales = {s for _, s in self._pairs}
        for key in sorted(holder):
            if key.endswith("_blocks") and key[: -len("_blocks")] + "_scales" in holder:
                raise UnsupportedValueError(
                    f"{self._where(holder[key])}: tensor {key!r} is MXFP4 (with {key[:-7] + '_scales'!r}), which "
                    "this reader does not dequantize; it reads FP8 weights with block-wise weight_scale_inv")
        quantized = {w for w, _ in self._pairs}
        for key, entry in meta.entries.items():
            if entry.dtype in _FLOAT8 and key not in quantized and key not in scales:
                expect = (f"{key + SCALE_SUFFIX!r} is in no file" if key.endswith(".weight")
                          else f"only '<name>.weight' tensors pair with '<name>.weight{SCALE_SUFFIX}'")
                raise UnsupportedValueError(
                    f"{self._where(holder[key])}: tensor {key!r} is {entry.dtype} with no scale ({expect}), so it "
                    "cannot be dequantized; load its raw values with HuggingFaceStorageReader")
        dtype = dtype_name(self.target_dtype)
        for n, (key, _) in enumerate(self._pairs):
            q = self._weight(n)
            name = virtual_name(n, key)
            if name in holder.values():
                raise UnsupportedValueError(f"{self._where(name)}: a file of the checkpoint has the name this reader "
                                            f"gives the dequantized {key!r}; rename the file")
            numel = q.rows * q.cols
            # no index of its own (offset and length 0); its crc is the weight file's header's
            meta.files.append(md.FileRecord(name, "", -1, 0, 0, q.header_crc, numel * itemsize(dtype)))
            chunks = 1 if numel else 0
            store = md.TableStore(np.zeros((chunks, 2), dtype=np.int64),
                                  np.array([[q.rows, q.cols]] * chunks, dtype=np.int64).reshape(chunks, 2),
                                  np.full(chunks, len(meta.files) - 1, dtype=np.int32))
            meta.entries[key] = md.Entry(key, "tensor", (key,), dtype, (q.rows, q.cols), store=store)
        meta.user = {**meta.user, "quantized": "fp8-block", "block_size": self.block_size}
        return meta.to_json()

    def file_index(self, record: md.FileRecord) -> UncheckedIndex:
        q = self._virtual(record.name)
        if q is None:
            return super().file_index(record)
        where = self._where(q.file)
        raw = read_header_bytes(self.files, q.file, where)  # the file as it is now
        if crc32c.crc32c(raw) != record.index_crc or q.header_crc != record.index_crc:
            raise CorruptCheckpointError(f"{where} changed since the load read its header (its header's checksum "
                                         f"differs); load again")
        return UncheckedIndex({(q.key, 0): (0, (q.rows, q.cols), record.size)}, where)

    def file_size(self, name: str) -> int:
        q = self._virtual(name)
        if q is None:
            return super().file_size(name)
        return q.rows * q.cols * self.target_dtype.itemsize

    # ------------------------------------------------------------------ data

    def read_into(self, name: str, offset: int, buffer: Buffer) -> None:
        q = self._virtual(name)
        if q is None:
            return super().read_into(name, offset, buffer)
        view = memoryview(buffer).cast("B")
        size = self.target_dtype.itemsize
        if offset % size or view.nbytes % size:  # not whole elements: through a temporary
            lo = offset - offset % size
            tmp = bytearray(-(-(offset + view.nbytes - lo) // size) * size)
            self._dequantize(q, lo // size, memoryview(tmp))
            view[:] = tmp[offset - lo:offset - lo + view.nbytes]
            return
        self._dequantize(q, offset // size, view)

    def _dequantize(self, q: QuantizedWeight, first: int, view: memoryview) -> None:
        """Elements ``first ..`` (row-major) of weight ``q``, dequantized into ``view``."""
        n = view.nbytes // self.target_dtype.itemsize
        if not n:
            return
        if first + n > q.rows * q.cols:
            raise CorruptCheckpointError(f"{self._where(q.file)}: elements {first}..{first + n} of {q.key!r} "
                                         f"lie beyond its {q.rows * q.cols}")
        out = torch.frombuffer(view, dtype=self.target_dtype)
        raw = torch.empty(n, dtype=torch.uint8)  # float8: one byte an element
        self.files.read_into(q.file, q.start + first, memoryview(raw.numpy()))
        weight = raw.view(torch_dtype(q.dtype))
        b, cols, end = self.block_size, q.cols, first + n
        pos = first
        while pos < end:
            r, c = divmod(pos, cols)
            if c or end - pos < cols:  # part of one row
                nrows, ncols = 1, min(cols - c, end - pos)
            else:  # whole rows, up to the end of this block row
                nrows, ncols = min((r // b + 1) * b - r, (end - pos) // cols), cols
            i = pos - first
            count = nrows * ncols
            scale = self._scale_row(q, r // b, c, c + ncols)
            _scale_into(out[i:i + count].view(nrows, ncols), weight[i:i + count].view(nrows, ncols), scale)
            pos += count

    def _scale_row(self, q: QuantizedWeight, block_row: int, c0: int, c1: int) -> torch.Tensor:
        """Each column's float32 scale for columns ``c0:c1`` of block row ``block_row``.

        Each scale cell is repeated once per column of ``c0:c1`` it covers (the first and last
        cells may cover part of their block), so memory follows the columns read, never
        ``block_size`` (which may exceed the weight by far: a 1 x 1 grid)."""
        b = self.block_size
        b0, b1 = c0 // b, -(-c1 // b)
        ssize = itemsize(q.scale_dtype)
        raw = torch.empty((b1 - b0) * ssize, dtype=torch.uint8)
        self.files.read_into(q.scale_file, q.scale_start + (block_row * q.scale_cols + b0) * ssize,
                             memoryview(raw.numpy()))
        return _column_scales(raw.view(torch_dtype(q.scale_dtype)), c0, c1, b)

    # ------------------------------------------------------------------ torch's per-item hook

    def _process_read_request(self, f: Any, req: Any, planner: Any) -> None:
        """torch's per-item hook (:meth:`HuggingFaceStorageReader._process_read_request`), which
        dequantizes a block-quantized weight's region.

        A weight is quantized when ``_weight_scale_mapping`` (torch's name) pairs it with its
        ``<name>.weight_scale_inv``; that map and ``_weight_map`` (tensor -> file) are filled
        when this reader reads the checkpoint's files (``read_metadata``, a load), or here on the
        first call when both are still empty. Code written for torch's reader may set them
        itself, as it may ``_tensor_full_shapes`` (weight -> full shape; a weight it leaves out
        has the shape ``f`` gives).

        The region's float8 (or any) values are read from ``f``, and the whole scale grid from
        ``f`` when the weight map puts it in the weight's file, else from the file it names,
        opened with ``safetensors.safe_open`` (local directories only). Each element is
        ``float32(weight) * float32(scale of its block)``, rounded to ``target_dtype``, then
        copied into the planner's tensor: the bits a load with this reader gives. Every other
        tensor (scales included) is read raw.

        Raises (each naming the tensor), besides the plain reader's:
            UnsupportedValueError: a quantized weight is not 2-D, its scale is not floating, or
                it is MXFP4 (``*_blocks`` with ``*_scales``); the scale's file is remote.
            CorruptCheckpointError: the weight map places the scale in no file; the scale
                grid is not ``ceil(rows / block_size) x ceil(cols / block_size)``; ``f`` gives
                a region of another shape than asked.
            CheckpointError: the region lies outside the weight.
        """
        key = req.storage_index.fqn
        scale_key = self._scale_of(key)
        if scale_key is None:
            super()._process_read_request(f, req, planner)
            return
        self._commit_read(req, planner, self._dequantized_region(f, req, key, scale_key))

    def _scale_of(self, key: str) -> str | None:
        """The scale tensor of quantized weight ``key``; None for any other tensor."""
        with self._lock:
            if self._pairs is None and not self._weight_map and not self._weight_scale_mapping:
                self._tensor_files()  # nothing known yet: learn the pairs from the files
            if key.endswith((SCALE_SUFFIX, "_scales")):
                return None
            if key.endswith("_blocks") and (key in self._weight_scale_mapping
                                            or key[: -len("_blocks")] + "_scales" in self._weight_map):
                raise UnsupportedValueError(
                    f"{self._file_of(key)}: tensor {key!r} is MXFP4 (with "
                    f"{key[: -len('_blocks')] + '_scales'!r}), which this reader does not dequantize; it reads FP8 "
                    "weights with block-wise weight_scale_inv")
            return self._weight_scale_mapping.get(key)

    def _file_of(self, key: str) -> str:
        """Where ``key`` lies, for messages: its file, else the checkpoint."""
        name = self._weight_map.get(key)
        return self._where(name) if name is not None else self.path

    def _dequantized_region(self, f: Any, req: Any, key: str, scale_key: str) -> torch.Tensor:
        """``req``'s region of quantized weight ``key``, dequantized to ``target_dtype``."""
        where = self._file_of(key)
        shape = self._tensor_full_shapes.get(key)
        if shape is None:
            shape = f.get_slice(key).get_shape()
        shape = tuple(int(n) for n in shape)
        if len(shape) != 2:
            raise UnsupportedValueError(f"{where}: {key!r} of shape {list(shape)} has scale {scale_key!r}, but only "
                                        "2-D weights are block-quantized")
        slices = self._region_slices(req)
        if len(slices) != 2 or any(not 0 <= s.start <= s.stop <= n for s, n in zip(slices, shape, strict=True)):
            raise CheckpointError(f"{where}: the read of {key!r} asks for {[(s.start, s.stop) for s in slices]}, "
                                  f"outside its shape {list(shape)}")
        weight = f.get_slice(key)[slices]
        lengths = tuple(s.stop - s.start for s in slices)
        if tuple(weight.shape) != lengths:
            raise CorruptCheckpointError(f"{where}: the read of {lengths} elements of {key!r} gave "
                                         f"{list(weight.shape)}")
        scale = self._scale_grid(f, key, scale_key)
        b = self.block_size
        grid = (-(-shape[0] // b), -(-shape[1] // b))
        if tuple(scale.shape) != grid:
            raise CorruptCheckpointError(
                f"{where}: scale {scale_key!r} has shape {list(scale.shape)}, but weight {key!r} of shape "
                f"{list(shape)} with block_size={b} needs {list(grid)} (ceil(rows / block) x ceil(cols / block)); "
                f"{_fitting_blocks(shape, tuple(scale.shape))}")
        if not scale.is_floating_point():
            raise UnsupportedValueError(f"{where}: scale {scale_key!r} of {key!r} is {scale.dtype}; expected a "
                                        "floating dtype")
        return dequantize_region(weight, scale, slices[0].start, slices[1].start, b, self.target_dtype)

    def _scale_grid(self, f: Any, key: str, scale_key: str) -> torch.Tensor:
        """The whole scale grid of ``key``: from ``f`` when in the weight's file, else from its own."""
        name = self._weight_map.get(scale_key)
        if name is None:
            raise CorruptCheckpointError(f"{self._file_of(key)}: scale {scale_key!r} of "
                                         f"{key!r} is in no file of the checkpoint's weight map")
        if name == self._weight_map.get(key):
            return f.get_tensor(scale_key)
        where = self._where(name)
        if is_url(self.path):
            raise UnsupportedValueError(f"{where}: scale {scale_key!r} of {key!r} is in another file than the weight, "
                                        "and safetensors opens local files only; load with load() instead")
        validate_file_name(name, self.path)
        # looked up when called, as torch's reader does: a caller that swaps the safetensors
        # module (to open files its own way) has its handles used for this file too
        import safetensors

        with safetensors.safe_open(os.path.join(local_path(self.path), name), framework="pt", device="cpu") as other:
            return other.get_tensor(scale_key)


def dequantize_region(weight: torch.Tensor, scale: torch.Tensor, row: int, col: int, block: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """The region of a block-quantized weight whose values ``weight`` holds (2-D, any dtype),
    at ``row``, ``col`` of the whole weight, dequantized: element ``(i, j)`` is
    ``float32(weight[i, j]) * float32(scale[(row + i) // block, (col + j) // block])``, rounded
    to ``dtype``. ``scale`` is the whole weight's grid. Memory follows the region, never
    ``block``."""
    rows, cols = weight.shape
    out = torch.empty((rows, cols), dtype=dtype)
    if not rows or not cols:
        return out
    b0, b1 = col // block, -(-(col + cols) // block)
    r = row
    while r < row + rows:  # one band of rows per block row
        band = r // block
        end = min((band + 1) * block, row + rows)
        _scale_into(out[r - row:end - row], weight[r - row:end - row],
                    _column_scales(scale[band, b0:b1], col, col + cols, block))
        r = end
    return out


def _column_scales(cells: torch.Tensor, c0: int, c1: int, block: int) -> torch.Tensor:
    """Each column's float32 scale for columns ``c0:c1`` (``c0 < c1``), from ``cells``: one
    block row's scale cells for blocks ``c0 // block`` to ``ceil(c1 / block)``.

    Each cell is repeated once per column of ``c0:c1`` it covers (the first and last cells may
    cover part of their block)."""
    b0, b1 = c0 // block, -(-c1 // block)
    counts = [block] * (b1 - b0)  # whole blocks only between the first and last cells
    counts[0] = min(c1, (b0 + 1) * block) - c0
    if b1 - b0 > 1:
        counts[-1] = c1 - (b1 - 1) * block
    return cells.to(torch.float32).repeat_interleave(torch.tensor(counts, dtype=torch.int64), output_size=c1 - c0)


def _scale_into(dest: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> None:
    """``dest = float32(weight) * scales`` (one scale per column), rounded once to ``dest``'s
    dtype: the float32 product first, as torch's reader computes it."""
    if dest.dtype == torch.float32:  # computed in place
        dest.copy_(weight).mul_(scales)
    else:
        dest.copy_(weight.to(torch.float32).mul_(scales))


_MAX_BLOCK = 2**63 - 1  # int64, as torch's reader and our metadata hold it
# A block may exceed a small weight (a 1 x 1 grid: 5 x 7 with 128 is ordinary); past this, and
# past the weight, the argument is a mistake (1 << 40 once asked the allocator for 4 TiB)
_MAX_USEFUL_BLOCK = 2**31 - 1


def _checked_block_size(block_size: object) -> int:
    """``block_size`` as an int, or ValueError naming it and what is expected."""
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral):
        raise ValueError(f"block_size must be an int (the rows and columns of one scale block; DeepSeek-V3: 128), "
                         f"found {type(block_size).__name__} {block_size!r:.60}")
    value = int(block_size)
    if not 1 <= value <= _MAX_BLOCK:
        raise ValueError(f"block_size must be from 1 to 2**63 - 1 (the rows and columns of one scale block; "
                         f"DeepSeek-V3: 128), found {value}")
    return value


def _fitting_blocks(shape: tuple[int, int], grid: tuple[int, ...]) -> str:
    """What to do about a scale grid that does not fit ``shape`` at the block size given: the
    block sizes it does fit (the argument is wrong), or that none does (the scale is not this
    weight's)."""
    lo, hi = 1, _MAX_BLOCK
    fits = len(grid) == 2
    for n, g in zip(shape, grid if fits else (), strict=False):
        if n == 0 or g == 0:  # an empty dim has an empty grid at any block size
            fits = fits and n == g == 0
            continue
        if g > n:
            fits = False
            break
        lo = max(lo, -(-n // g))  # ceil(n / b) == g  <=>  ceil(n / g) <= b <= floor((n - 1) / (g - 1))
        hi = min(hi, (n - 1) // (g - 1) if g > 1 else _MAX_BLOCK)
    if fits and lo <= hi:
        sizes = f"block_size={lo}" if lo == hi else (f"block_size >= {lo}" if hi == _MAX_BLOCK
                                                     else f"block_size from {lo} to {hi}")
        return f"this grid fits {sizes}: pass the checkpoint's block size (its config's weight_block_size)"
    return "no block size gives this grid: the scale does not belong to this weight"

"""MindSpore checkpoints: read and write ``..ckpt`` and MindSpore safetensors, no MindSpore needed.

A MindSpore ``..ckpt`` is protobuf (``checkpoint.proto``): a run of ``Checkpoint`` messages,
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

- :func:`read_mindspore_checkpoint`: a ``..ckpt`` or safetensors file -> ``{name: tensor}``.
- :func:`import_mindspore`: a file -> a DCP checkpoint; or a MindSpore *distributed* checkpoint
  (``rank_<id>/`` directories of sliced files plus the strategy file) -> a DCP checkpoint that
  records each slice with its saved layout, so :func:`load` reshards it onto any torch mesh.
- :func:`export_mindspore`: a DCP checkpoint -> one ``..ckpt`` or safetensors file that
  ``mindspore.load_checkpoint`` reads bit-exact (byte-identical to MindSpore's own writer).

Strategy files are ``mindspore_strategy.py``'s concern.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...backends.filesystem import FileSystemReader
from ...base.atomic_file import atomic_file
from ...base.box import Box
from ...base.errors import CheckpointError, UnsupportedValueError
from ...engine.metadata_reader import read_checkpoint_metadata
from ...engine.streaming_writer import write_streaming
from ...format import metadata as md
from ...format.data_file import tensor_bytes
from ...format.safetensors import METADATA_KEY
from ...planning.planner import EntrySpec, WriteItem
from ...state.flatten import prefixed_path
from ...transfer.loader import read_box
from .ckpt import write_ckpt
from .distributed import import_distributed, rank_files
from .file_model import _TO_MS, MS_DTYPES, STR, MindSporeFile
from .reader import open_mindspore_file, read_mindspore_checkpoint
from .safetensors_files import write_safetensors

__all__ = ["read_mindspore_checkpoint", "import_mindspore", "export_mindspore", "MindSporeFile",
           "open_mindspore_file", "ExportSummary", "MS_DTYPES"]

log = logging.getLogger(__name__)


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

    - a ``..ckpt`` or MindSpore safetensors file: every tensor whole (string values become
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
        ranks = rank_files(src)
        if not ranks:
            raise CheckpointError(f"{src} is a directory without rank_<id>/ sub-directories of .ckpt or "
                                  ".safetensors files; pass a checkpoint file, or a MindSpore distributed "
                                  "checkpoint directory")
        if strategy is None:
            raise ValueError(f"{src} is a MindSpore distributed checkpoint ({len(ranks)} rank directories); "
                             "pass its strategy file (strategy=..., CLI --strategy FILE): the slices alone "
                             "do not say where they belong")
        return import_distributed(src, ranks, os.fspath(strategy), dst_path, prefix, verify, overwrite, progress)
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
    """Write a DCP checkpoint as one MindSpore ``..ckpt`` (or safetensors) file, whole tensors.

    The file is what ``mindspore.save_checkpoint`` writes for the same tensors, byte for byte
    (tensors above 512 MiB in several messages), so ``mindspore.load_checkpoint`` reads it
    bit-exact. It streams: one tensor in memory at a time. Plain values become what MindSpore
    keeps in ``append_dict``: strings stay strings (``..ckpt`` only), ints/floats/bools become
    0-d Int64/Float64/Bool tensors; other values (bytes, lists, dicts, None) are skipped and
    listed in the summary.

    Args:
        src: a DCP checkpoint directory.
        dst: the file to write (written to a temporary name, then renamed).
        format: ``"ckpt"`` or ``"safetensors"``; by default from ``dst``'s extension.
        prefix: export only keys starting with it, with it removed (e.g. ``"model."``).
        crc: add MindSpore's crc (the ``..ckpt`` ``crc_num`` trailer, or safetensors
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

        def wrote(nbytes: int) -> None:
            summary.tensors += 1
            summary.bytes += nbytes
            if progress is not None:
                progress(nbytes)

        with atomic_file(dst, sync_dir=False) as out:
            (write_ckpt if fmt == "ckpt" else write_safetensors)(out, plan, data, crc, wrote)
    finally:
        reader.close()
    summary.seconds = time.perf_counter() - t0
    return summary

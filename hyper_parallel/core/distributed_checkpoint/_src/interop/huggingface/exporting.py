"""Hugging Face export: a checkpoint (or a full state dict) as sharded safetensors files.

:func:`save_state_dict_as_huggingface_format` streams one tensor at a time into
``model-0000i-of-0000N.safetensors`` files and ``model.safetensors.index.json``, as
``save_pretrained`` lays them out, and swaps them in so that a crash leaves the earlier
export or the new one, never a mix.

Not here: the safetensors bytes (:mod:`...format.safetensors`), the directory's names and
index (:mod:`.index`), reading HF checkpoints (:mod:`.reader`, :mod:`.importing`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...backends.protocol import StorageReader
from ...backends.resolve import reader_for
from ...base.atomic_file import sync_directory, write_atomically
from ...base.dtypes import dtype_name
from ...base.errors import CheckpointError, UnsupportedValueError
from ...base.sizes import parse_size
from ...engine.metadata_reader import read_checkpoint_metadata
from ...format import metadata as md
from ...format.data_file import tensor_bytes
from ...format.safetensors import METADATA_KEY, contiguous_header, encode_header, nbytes_of
from ...state.flatten import flatten
from ...transfer.loader import read_box
from .index import EXPORT_NAME, HF_INDEX


def _write_safetensors(path: str, tensors: list[tuple[str, str, tuple[int, ...]]],
                       produce: Callable[[str], torch.Tensor], extra: dict[str, str]) -> None:
    """Write a safetensors file at ``path`` (a temporary name: the caller renames it), synced."""
    try:
        with open(path, "wb") as f:
            f.write(encode_header(contiguous_header(tensors, extra)))
            for name, _, _ in tensors:
                f.write(tensor_bytes(produce(name)))
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise


def _tensor_entries(meta: md.Metadata, prefix: str) -> list[md.Entry]:
    return [e for k, e in meta.entries.items() if e.kind in ("tensor", "ndarray") and k.startswith(prefix)]


def save_state_dict_as_huggingface_format(
    src: str | os.PathLike | Mapping[str, Any] | None = None,
    dst_dir: str | os.PathLike | Mapping[str, Any] | None = None,
    max_shard_size: int | str = "5GB",
    *,
    prefix: str = "",
    verify: bool = True,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
    save_directory: str | os.PathLike | None = None,
    state_dict: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Export tensors as Hugging Face sharded safetensors, streaming one tensor at a time.

    Writes ``model-0000i-of-0000N.safetensors`` files of at most ``max_shard_size`` each
    (a single larger tensor gets a file of its own) and ``model.safetensors.index.json``.
    With one shard the file is named ``model.safetensors`` and no index is written, as
    ``transformers`` does. Shards are written under temporary names and renamed at the end,
    so an export killed midway (``overwrite=True`` too) leaves the earlier export whole, the new
    one whole, or shards without an index, which readers refuse; never a mix of the two.

    Two argument orders are accepted: ours, ``(src, dst_dir)`` with ``src`` a checkpoint path
    or a state dict; and HyperParallel's, ``(save_directory, state_dict, max_shard_size)``,
    recognised by a state dict in second place (or by the keywords ``save_directory=`` and
    ``state_dict=``). Non-tensor values of a state dict are left out.

    Args:
        src: a checkpoint path, or an in-memory state dict of full tensors.
        dst_dir: the output directory.
        max_shard_size: bytes per shard file: an int or a string like ``"5GB"``.
        prefix: export only keys starting with it, with it removed (e.g. ``"model."``).
        progress: called with each tensor's byte count once it is written.
        save_directory, state_dict: HyperParallel's names for ``dst_dir`` and ``src``.

    Returns:
        The index dict (``{"metadata": {"total_size": ...}, "weight_map": {...}}``).

    Raises:
        TypeError: neither order fits the arguments.
        CheckpointError: no tensors to export; the directory already holds safetensors files
            and ``overwrite`` is False.

    Example::

        save_state_dict_as_huggingface_format("/ckpt/step100", "/hf", prefix="model.")
        save_state_dict_as_huggingface_format("/hf", model.state_dict(), max_shard_size="1GB")
    """
    if isinstance(dst_dir, Mapping) and src is not None and not isinstance(src, Mapping):
        src, dst_dir = dst_dir, src  # HyperParallel's order: (save_directory, state_dict)
    if save_directory is not None or state_dict is not None:
        if (save_directory is not None and dst_dir is not None) or (state_dict is not None and src is not None):
            raise TypeError("pass the directory and the state dict once each")
        dst_dir = save_directory if save_directory is not None else dst_dir
        src = state_dict if state_dict is not None else src
    if src is None or dst_dir is None or isinstance(dst_dir, Mapping):
        raise TypeError("save_state_dict_as_huggingface_format needs (src, dst_dir) or "
                        "(save_directory, state_dict)")
    limit = parse_size(max_shard_size)
    os.makedirs(dst_dir, exist_ok=True)
    if not overwrite and any(f.endswith(".safetensors") or f == HF_INDEX for f in os.listdir(dst_dir)):
        raise CheckpointError(f"{os.fspath(dst_dir)!r} already holds safetensors files; pass overwrite=True")
    if isinstance(src, Mapping):
        flat = {k: leaf.value for k, leaf in flatten(dict(src)).leaves.items()
                if isinstance(leaf.value, torch.Tensor) and k.startswith(prefix)}
        from torch.distributed.tensor import DTensor

        sharded = [k for k, v in flat.items() if isinstance(v, DTensor)]
        if sharded:
            raise UnsupportedValueError(
                f"{sharded[0]!r} is a DTensor ({len(sharded)} in all): a Hugging Face export needs full tensors. "
                "Pass a checkpoint path instead, or a full state dict (get_model_state_dict(model, "
                "options=StateDictOptions(full_state_dict=True, cpu_offload=True)) on rank 0)")
        tensors = [(k[len(prefix):], dtype_name(v.dtype), tuple(v.shape)) for k, v in flat.items()]
        produce: Callable[[str], torch.Tensor] = lambda name: flat[prefix + name]
        close = lambda: None
    else:
        reader = src if isinstance(src, StorageReader) else reader_for(src)
        meta = read_checkpoint_metadata(reader)
        entries = {e.key[len(prefix):]: e for e in _tensor_entries(meta, prefix)}
        tensors = [(name, e.dtype, tuple(e.shape)) for name, e in entries.items()]
        produce = lambda name: read_box(entries[name], reader, verify=verify)[0]
        close = reader.close
    if not tensors:
        raise CheckpointError(f"no tensors to export (prefix {prefix!r})")
    if any(name == METADATA_KEY for name, _, _ in tensors):
        raise UnsupportedValueError(
            f"tensor {prefix + METADATA_KEY!r}: safetensors reserves the name {METADATA_KEY!r} for its header's "
            "metadata, so no tensor can have it; rename the tensor before exporting")
    shards: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
    size = 0
    for t in tensors:
        n = nbytes_of(t[1], t[2])
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    total = len(shards)
    weight_map, total_size = {}, 0
    tag = uuid.uuid4().hex[:8]
    written: list[tuple[str, str]] = []  # (temporary path, final name)
    try:
        for i, shard in enumerate(shards, 1):
            name = "model.safetensors" if total == 1 else f"model-{i:05d}-of-{total:05d}.safetensors"
            tmp = os.path.join(dst_dir, temporary_name(name, tag))
            _write_safetensors(tmp, shard, produce, {"format": "pt"})
            written.append((tmp, name))
            for tname, dtype, shape in shard:
                weight_map[tname] = name
                n = nbytes_of(dtype, shape)
                total_size += n
                if progress is not None:
                    progress(n)
    except BaseException:
        for tmp, _ in written:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        raise
    finally:
        close()
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    swap_in_export(dst_dir, written, index if total > 1 else None)
    return index


_TMP = ".tmp-"  # a file being written: "<final name>.tmp-<8 hex digits>"


def temporary_name(name: str, tag: str) -> str:
    """The name file ``name`` of an export is written under until :func:`swap_in_export` puts
    it in place; ``tag``: 8 hex digits, one per export (the debris of a killed one is found by it)."""
    return f"{name}{_TMP}{tag}"


_HF_DEBRIS = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?\.tmp-[0-9a-f]{8}$")


def swap_in_export(dst_dir: str | os.PathLike, written: list[tuple[str, str]], index: dict[str, Any] | None) -> None:
    """Replace an earlier export in ``dst_dir`` by the shards ``written`` (synced, under temporary
    names) so that a crash at any point leaves the old export whole, the new one whole, or a
    directory no reader takes for a checkpoint (never old and new shards under one index):

    1. the old index goes first (without an index, readers take shards named ``-of-N`` only as
       one whole set, and none while a file of this export is under its temporary name:
       :func:`.index.indexless_files`), and so
       does an old ``model.safetensors`` the new export does not replace (transformers would
       take it over the new index);
    2. the new shards take their names, the directory is synced;
    3. the new index is written (the commit; none for a single ``model.safetensors``);
    4. shards of the old export the new index does not name, and debris of killed exports, go.
    """
    index_path = os.path.join(dst_dir, HF_INDEX)
    stale = _previous_export(dst_dir) - {name for _, name in written}
    if os.path.exists(index_path):
        os.remove(index_path)
        sync_directory(dst_dir)
    # Before any rename: what a reader would take instead of the new export. Without a new
    # index, every old shard (an old model.safetensors or its shards would win over the new
    # single file, half renamed); with one, an old model.safetensors (transformers looks for
    # it before the index).
    early = stale if index is None else stale & {"model.safetensors"}
    if early:
        for name in sorted(early):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(dst_dir, name))
        stale -= early
        sync_directory(dst_dir)
    for tmp, name in written:
        os.replace(tmp, os.path.join(dst_dir, name))
    sync_directory(dst_dir)
    if index is not None:
        write_atomically(index_path, json.dumps(index, indent=2).encode())
    for name in sorted(stale | {f for f in os.listdir(dst_dir) if _HF_DEBRIS.match(f)}):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(dst_dir, name))



def _previous_export(dst_dir: str | os.PathLike) -> set[str]:
    """Shard files of an earlier export in ``dst_dir`` (by its index, else by HF's naming)."""
    names = {f for f in os.listdir(dst_dir) if EXPORT_NAME.match(f)}
    try:
        with open(os.path.join(dst_dir, HF_INDEX)) as f:
            names |= {n for n in json.load(f).get("weight_map", {}).values()
                      if isinstance(n, str) and EXPORT_NAME.match(n)}
    except (OSError, ValueError, AttributeError):
        pass
    return names

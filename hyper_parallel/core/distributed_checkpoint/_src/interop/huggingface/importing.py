"""Hugging Face import: a safetensors checkpoint (a directory or one file) read whole, or
streamed into a checkpoint of this format one tensor at a time.

Every file's header is validated by the one parser (:func:`~...format.safetensors.check_safetensors_file`)
before the ``safetensors`` library opens it; the tensors are then read with ``safe_open``,
each file opened once (it parses the whole header on every open).

Not here: loading an HF directory straight into a model (:mod:`.reader`), the export
(:mod:`.exporting`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

import torch

from ...base.box import Box
from ...base.dtypes import safetensors_dtype
from ...base.errors import UnsupportedValueError
from ...engine.streaming_writer import write_streaming
from ...format import metadata as md
from ...format.safetensors import check_safetensors_file, nbytes_of
from ...planning.planner import EntrySpec, WriteItem
from ...state.flatten import prefixed_path
from ..hyper_parallel.aliases import one_of
from .index import local_sources, names_to_read


def _files(src: str | os.PathLike) -> list[tuple[str, dict[str, Any]]]:
    """Each file of the checkpoint with the tensors to read from it (name -> header record),
    the headers validated, the index obeyed, a tensor in two files without an index refused."""
    seen: dict[str, str] = {}
    out = []
    for path, wanted in local_sources(src).items():
        tensors = check_safetensors_file(path).tensors
        out.append((path, {name: tensors[name] for name in names_to_read(path, wanted, sorted(tensors), seen)}))
    return out


def parse_checkpoint_from_huggingface(src: str | os.PathLike | None = None, *, prefix: str = "",
                                      resume_from_checkpoint: str | os.PathLike | None = None
                                      ) -> dict[str, torch.Tensor]:
    """Read a Hugging Face safetensors checkpoint (a directory or one file) into a state dict.

    Keys get ``prefix`` prepended (e.g. ``"model."`` to match ``{"model": model.state_dict()}``).
    With an index, each tensor comes from the shard its ``weight_map`` names.
    ``resume_from_checkpoint`` is HyperParallel's name for ``src``.
    """
    src = one_of(src, resume_from_checkpoint, "src", "resume_from_checkpoint", "parse_checkpoint_from_huggingface")
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for path, tensors in _files(src):
        with safe_open(path, framework="pt") as f:
            for name in tensors:
                out[prefix + name] = f.get_tensor(name)
    return out


def import_huggingface(src: str, dst_path: str | os.PathLike, *, prefix: str = "",
                       overwrite: bool = False) -> md.Metadata:
    """Stream a Hugging Face safetensors checkpoint into a new checkpoint, one tensor at a time."""
    from safetensors import safe_open

    where: dict[str, tuple[str, str]] = {}
    entries: dict[str, EntrySpec] = {}
    items: list[WriteItem] = []
    for path, tensors in _files(src):
        for name, t in tensors.items():
            if safetensors_dtype(t.dtype) is None:  # safetensors' torch binding cannot read it
                raise UnsupportedValueError(f"{path}: tensor {name!r} has unsupported dtype {t.dtype}")
            key = prefix + name
            where[key] = (path, name)
            entries[key] = EntrySpec("tensor", prefixed_path(prefix, name), t.dtype, t.shape)
            nbytes = nbytes_of(t.dtype, t.shape)
            if nbytes:
                items.append(WriteItem(key, Box.full(t.shape), nbytes))

    handles: dict[str, Any] = {}  # one open file each: safe_open parses the whole header
    lock = threading.Lock()

    def produce(item: WriteItem) -> torch.Tensor:
        path, name = where[item.key]
        with lock:
            f = handles.get(path)
            if f is None:
                f = handles[path] = stack.enter_context(safe_open(path, framework="pt"))
            return f.get_tensor(name)

    with contextlib.ExitStack() as stack:
        return write_streaming(dst_path, entries, [items], produce, overwrite=overwrite)

"""Consolidating torch's sharded Hugging Face safetensors into whole-tensor files, as torch's
``_consolidate_hf_safetensors`` module does (torchtitan and others import it by that path).

Input: a directory that ``HuggingFaceStorageWriter(path, save_distributed=True)`` wrote (ours or
torch's): files of every rank's shards, each header naming its shards' offsets. Output: one
safetensors file per index of ``fqn_to_index_mapping`` (``model-0000i-of-0000N.safetensors``,
torch's names), every tensor whole, and ``model.safetensors.index.json`` (``weight_map`` and
``metadata.total_size``) written last, once every file is in place, so a directory with the
index is complete. Each output file is written atomically (a temporary name, then renamed).

Memory: the tensors of one output file at a time (read with the loader's checked, parallel
reads from whichever shards hold them: :class:`~.reader.TorchShardedSafetensorsReader`),
never the whole model. On every rank (:func:`consolidate_safetensors_files_on_every_rank`),
rank ``r`` of ``n`` writes the files whose index is ``r`` modulo ``n``; a failure on any rank
fails every rank, naming it, and no index is written.

Unlike torch's: tensors of any dtype (torch's needs a floating one), ``fqn_to_index_mapping``
may be None (one file), a mapped key the shards lack is an error naming it, and checkpoint
keys the mapping leaves out are named in a warning (torch drops them silently).

What it is not: the sharded reader (:mod:`.reader`) nor the writer that skips this pass
altogether (:class:`~.writer.HuggingFaceStorageWriter` with ``enable_consolidation=True``).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ...base.atomic_file import atomic_file, write_atomically
from ...base.dtypes import dtype_name, itemsize
from ...base.errors import StateDictMismatchError
from ...coordination.coordinator import Coordinator
from ...engine.checkpoint import load
from ...format.safetensors import contiguous_header, encode_header
from .index import SAFETENSORS_INDEX_SUFFIX
from .reader import TorchShardedSafetensorsReader

__all__ = ["consolidate_safetensors_files", "consolidate_safetensors_files_on_every_rank", "output_file_name"]

INDEX_FILE = f"model{SAFETENSORS_INDEX_SUFFIX}"


def output_file_name(index: int, largest_index: int) -> str:
    """torch's name of output file ``index`` of ``largest_index``: ``model-00001-of-00004.safetensors``."""
    return f"model-{index:05d}-of-{largest_index:05d}.safetensors"


def consolidate_safetensors_files(input_dir: str | os.PathLike, output_dir: str | os.PathLike,
                                  fqn_to_index_mapping: Mapping[str, int] | None = None,
                                  num_threads: int = 1) -> None:
    """Write the whole tensors of the sharded safetensors in ``input_dir`` into ``output_dir``,
    in this process alone.

    Args:
        input_dir: the shards (``HuggingFaceStorageWriter(..., save_distributed=True)``'s output).
        output_dir: where the files and the index go (created if missing).
        fqn_to_index_mapping: the output file (1..N) of each tensor; None: one file.
        num_threads: reader threads per output file.

    Raises:
        ValueError: a mapping index that is not an int >= 1, or ``num_threads`` < 1.
        StateDictMismatchError: a mapped key the shards do not hold.
        NotACheckpointError / CorruptCheckpointError: ``input_dir`` holds no shards, or shards
            that do not tile their tensors (the message names the file and key).

    Example::

        consolidate_safetensors_files("/ckpt/step-9/sharded", "/ckpt/step-9", {"w": 1, "b": 1})
    """
    _consolidate(os.fspath(input_dir), os.fspath(output_dir), fqn_to_index_mapping, num_threads,
                 Coordinator(no_dist=True))


def consolidate_safetensors_files_on_every_rank(input_dir: str | os.PathLike, output_dir: str | os.PathLike,
                                                fqn_to_index_mapping: Mapping[str, int] | None,
                                                num_threads: int = 1, process_group: Any = None) -> None:
    """:func:`consolidate_safetensors_files` with the output files shared among the ranks of
    ``process_group`` (every rank calls it; alone without a process group). Raises on every
    rank, as :class:`~..errors.RankFailedError`, what failed on any."""
    _consolidate(os.fspath(input_dir), os.fspath(output_dir), fqn_to_index_mapping, num_threads,
                 Coordinator(process_group))


def _consolidate(input_dir: str, output_dir: str, mapping: Mapping[str, int] | None, num_threads: int,
                 coord: Coordinator) -> None:
    if type(num_threads) is not int or num_threads < 1:
        raise ValueError(f"num_threads must be an int >= 1, got {num_threads!r}")
    if mapping is not None:
        bad = next(((k, i) for k, i in mapping.items() if type(i) is not int or i < 1), None)
        if bad is not None:
            raise ValueError(f"fqn_to_index_mapping maps {bad[0]!r} to {bad[1]!r}; file indices are ints from 1")

    def plan() -> tuple[dict[str, Any], dict[str, int]]:
        saved = {k: (tuple(v.size), v.properties.dtype)
                 for k, v in TorchShardedSafetensorsReader(input_dir).read_metadata().state_dict_metadata.items()}
        files = dict(mapping) if mapping is not None else {k: 1 for k in saved}
        missing = sorted(set(files) - set(saved))
        if missing:
            raise StateDictMismatchError(
                f"fqn_to_index_mapping names {len(missing)} tensor(s) the shards in {input_dir!r} do not hold: "
                f"{missing[:10]}{' ...' if len(missing) > 10 else ''}")
        return saved, files

    saved, files = coord.exchange("consolidating safetensors (reading the shards' headers)", plan)[coord.rank]
    left_out = sorted(set(saved) - set(files))
    if left_out and coord.rank == 0:
        more = " ..." if len(left_out) > 10 else ""
        warnings.warn(f"consolidating {input_dir!r}: {len(left_out)} tensor(s) are in no output file (not in "
                      f"fqn_to_index_mapping) and are not written: {left_out[:10]}{more}", stacklevel=3)
    largest = max(files.values(), default=1)
    mine = sorted(i for i in set(files.values()) if i % coord.world_size == coord.rank)

    def write_mine() -> None:
        os.makedirs(output_dir, exist_ok=True)
        for index in mine:
            keys = sorted(k for k, i in files.items() if i == index)
            tensors = {k: torch.empty(saved[k][0], dtype=saved[k][1]) for k in keys}
            load(tensors, storage_reader=TorchShardedSafetensorsReader(input_dir), no_dist=True,
                 thread_count=num_threads)
            _write_file(os.path.join(output_dir, output_file_name(index, largest)), tensors)
            del tensors

    coord.exchange("consolidating safetensors (writing the files)", write_mine)

    def write_index() -> None:
        if coord.rank != 0:
            return
        total = sum(math.prod(saved[k][0]) * itemsize(dtype_name(saved[k][1])) for k in files)
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: output_file_name(files[k], largest) for k in sorted(files)}}
        write_atomically(os.path.join(output_dir, INDEX_FILE), json.dumps(index, indent=2))

    coord.exchange("consolidating safetensors (writing the index)", write_index)


def _write_file(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """One safetensors file of ``tensors`` (in key order), written atomically, no copy of the data."""
    header = contiguous_header([(k, dtype_name(t.dtype), tuple(t.shape)) for k, t in tensors.items()], {"format": "pt"})
    with atomic_file(path) as f:
        f.write(encode_header(header))
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))

"""A region-read plan carried out straight from local safetensors files, without the generic ``load``.

Why: ``load`` serves any storage and any planner. For a Hugging Face checkpoint of thousands of
small tensors its fixed per-tensor costs outweigh the bytes: rank 0 reads every header and encodes
the metadata, every rank decodes it, the plans go to rank 0 and back, and each read passes through
several layers. Measured on the MoE benchmark (``benchmarks/bench_hf_moe.py``, 1,611 tensors) that
made the planner as slow as reading every tensor whole on every rank. Here each rank instead

1. reads the safetensors headers itself (one small read per file; every rank gets the same answer
   from the same files, so nothing is exchanged) and builds the metadata the planner plans from;
2. plans with the planner (:meth:`set_up_planner`, :meth:`create_local_plan`, :meth:`finish_plan`);
3. reads its items in file order, adjacent byte ranges in one ``preadv`` straight into their
   destinations (the planner's :meth:`resolve_tensor`); a read whose destination is not a plain
   run of the same dtype lands in a staging buffer first, copied (and cast) into place after;
4. hands every read to the planner's :meth:`commit_tensor`.

The ranks agree on the outcome twice, after planning and after reading, with one small
``all_reduce`` each, so an error on one rank fails the load on every rank (the others name it).

Used by :func:`~.huggingface_load_planner.load_hf_checkpoint` when the model's tensors are on the
CPU, no storage reader or ``load`` argument is given and replicated shards are not broadcast; any
other load goes through ``load``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.tensor import DTensor

from hyper_parallel.core.distributed_checkpoint import CorruptCheckpointError

from .checkpoint_files import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, read_weight_map

__all__ = ["LocalSafetensors", "open_local_safetensors", "can_load_locally", "run_local_load"]

MAX_STAGED_BYTES = 16 << 20
"""Staging buffers held at once (reads that cannot land straight in their destination); a batch of
reads is carried out and its buffers freed before more are allocated."""

MAX_SPAN_WASTE = 1 << 20
"""A box of a checkpoint tensor that is not one run of bytes is read as the span from its first to
its last byte when that span is at most four times the box plus this; else run by run."""

_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U16": torch.uint16,
           "U32": torch.uint32, "U64": torch.uint64, "C64": torch.complex64}
"""safetensors dtype names and the torch dtypes the ``safetensors`` library loads them as."""


@dataclass(frozen=True)
class _Stored:
    """A tensor of a safetensors file: dtype, shape, absolute offset of its first byte."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int


def _read_header(path: Path) -> dict[str, _Stored]:
    """The tensors of one safetensors file, after the ``safetensors`` library has validated its
    header (dtypes, shapes, byte ranges that tile the data), as the legacy loader relies on it."""
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as exc:  # the library's errors name neither the file nor the tensor
        raise CorruptCheckpointError(f"{str(path)!r} is not a readable safetensors file: {exc}") from exc
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{str(path)!r}: tensor {key!r} has dtype {info['dtype']!r}, which this loader cannot "
                             "read in place")
        out[key] = _Stored(dtype, tuple(info["shape"]), 8 + length + info["data_offsets"][0])
    return out


@dataclass
class LocalSafetensors:
    """A local Hugging Face checkpoint's tensors: the file each is in and where in it."""

    directory: Path
    file_of: dict[str, str]
    tensors: dict[str, _Stored]
    _fds: dict[str, int] = field(default_factory=dict, repr=False)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].dtype

    def fd(self, name: str) -> int:
        """An open descriptor of file ``name`` (opened on first use, kept until :meth:`close`)."""
        fd = self._fds.get(name)
        if fd is None:
            fd = self._fds[name] = os.open(self.directory / name, os.O_RDONLY | os.O_CLOEXEC)
        return fd

    def read_into(self, name: str, offset: int, buffers: list[memoryview]) -> None:
        """Fill ``buffers``, in order, from byte ``offset`` of file ``name`` (``preadv``, short reads resumed).

        Raises:
            CorruptCheckpointError: the file ends first (names it).
        """
        fd = self.fd(name)
        views = [b for b in buffers if b.nbytes]
        while views:
            done = os.preadv(fd, views[:_IOV_MAX], offset)
            if done == 0:
                raise CorruptCheckpointError(f"{str(self.directory / name)!r} ends early: wanted "
                                             f"{sum(v.nbytes for v in views)} more bytes at offset {offset}")
            offset += done
            while views and done >= views[0].nbytes:
                done -= views[0].nbytes
                views.pop(0)
            if done:
                views[0] = views[0][done:]

    def metadata(self) -> Metadata:
        """torch DCP metadata of the checkpoint: every tensor one chunk, whole, in its stored dtype."""
        entries = {}
        for key, info in self.tensors.items():
            size = torch.Size(info.shape)
            entries[key] = TensorStorageMetadata(TensorProperties(dtype=self.dtype(key)), size,
                                                 [ChunkStorageMetadata(torch.Size((0,) * len(size)), size)])
        return Metadata(state_dict_metadata=entries)

    def close(self) -> None:
        """Close the files."""
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


def open_local_safetensors(location: Path) -> LocalSafetensors:
    """The checkpoint at ``location``: a ``.safetensors`` file, or a directory with
    ``model.safetensors.index.json`` (its ``weight_map``'s tensors, each in the file it names) or
    ``model.safetensors``, as the legacy loader reads them.

    Raises:
        FileNotFoundError: the directory has neither file.
        ValueError: the index is no index, or names a tensor its file's header lacks.
        CorruptCheckpointError: a damaged file (names it and the tensor).
    """
    location = Path(location)
    if location.is_file():
        directory, names, weight_map = location.parent, [location.name], None
    elif (location / SAFE_WEIGHTS_INDEX_NAME).is_file():
        weight_map = read_weight_map(location / SAFE_WEIGHTS_INDEX_NAME)
        directory, names = location, sorted(set(weight_map.values()))
    elif (location / SAFE_WEIGHTS_NAME).is_file():
        directory, names, weight_map = location, [SAFE_WEIGHTS_NAME], None
    else:
        raise FileNotFoundError(f"{str(location)!r} has neither {SAFE_WEIGHTS_INDEX_NAME} nor {SAFE_WEIGHTS_NAME}")
    headers = {name: _read_header(directory / name) for name in names}
    if weight_map is None:
        ((name, tensors),) = headers.items()
        return LocalSafetensors(directory, dict.fromkeys(tensors, name), dict(tensors))
    tensors = {}
    for key, name in weight_map.items():
        found = headers[name].get(key)
        if found is None:
            raise ValueError(f"the index puts {key!r} in {name!r}, whose header has no such tensor")
        tensors[key] = found
    return LocalSafetensors(directory, dict(weight_map), tensors)


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def can_load_locally(state_dict: Mapping[str, Any]) -> bool:
    """Whether :func:`run_local_load` can fill ``state_dict``: CPU tensors only, and a default
    process group (if any) that carries CPU tensors."""
    if not all(isinstance(v, torch.Tensor) and _local(v).device.type == "cpu" for v in state_dict.values()):
        return False
    if not (dist.is_available() and dist.is_initialized()):
        return True
    backend = str(dist.get_backend()).lower()
    if ":" in backend:  # "cpu:gloo,cuda:nccl"
        return "cpu" in {pair.split(":")[0] for pair in backend.split(",")}
    return "cpu" in (dist.Backend.backend_capability.get(backend) or ["cpu"])


def _agree(error: BaseException | None, what: str) -> None:
    """Raise ``error`` here, or a RuntimeError naming the ranks where ``what`` failed, on every rank."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        failed = torch.zeros(dist.get_world_size(), dtype=torch.int32)
        failed[dist.get_rank()] = int(error is not None)
        dist.all_reduce(failed)
        ranks = [r for r, f in enumerate(failed.tolist()) if f]
    else:
        ranks = []
    if error is not None:
        raise error
    if ranks:
        raise RuntimeError(f"{what} failed on rank(s) {ranks} (their own errors say why); this rank stops too")


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


@dataclass
class _Segment:
    """``nbytes`` bytes of file ``file`` from ``offset``, read into ``into``."""

    file: str
    offset: int
    into: memoryview


@dataclass
class _Read:
    """One plan item: its byte segments, the staging buffer (None: they land in place) and what
    to do once they are in."""

    item: Any
    dest: torch.Tensor
    segments: list[_Segment]
    staged: int
    finish: Callable[[], None] | None


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, step = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        out[d] = step
        step *= shape[d]
    return out


def _plan_read(checkpoint: LocalSafetensors, item: Any, dest: torch.Tensor) -> _Read:
    """The segments that read ``item``'s box of its checkpoint tensor into ``dest``."""
    key = item.storage_index.fqn
    info = checkpoint.tensors.get(key)
    if info is None:
        raise ValueError(f"the plan reads checkpoint tensor {key!r}, which the checkpoint does not have")
    file, dtype, shape = checkpoint.file_of[key], checkpoint.dtype(key), info.shape
    chunk = tuple(item.storage_index.offset or (0,) * len(shape))
    offsets = tuple(c + int(o) for c, o in zip(chunk, item.storage_offsets, strict=True))
    lengths = tuple(int(n) for n in item.lengths)
    if tuple(dest.shape) != lengths:
        raise RuntimeError(f"the planner resolved a read of {key!r} of size {lengths} to a tensor of "
                           f"shape {tuple(dest.shape)}")
    size = dtype.itemsize
    strides = _strides(shape)
    numel = 1
    for n in lengths:
        numel *= n
    if not numel:
        return _Read(item, dest, [], 0, None)
    first = sum(o * s for o, s in zip(offsets, strides, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides, strict=True))
    span = last - first + 1
    start = info.start + first * size
    if span == numel:  # one run of bytes
        if dest.dtype == dtype and dest.is_contiguous() and dest.device.type == "cpu":
            return _Read(item, dest, [_Segment(file, start, _bytes_of(dest))], 0, None)
        staging = torch.empty(lengths, dtype=dtype)

        def finish_run() -> None:
            dest.copy_(staging)

        return _Read(item, dest, [_Segment(file, start, _bytes_of(staging))], numel * size, finish_run)
    if span * size <= 4 * numel * size + MAX_SPAN_WASTE:  # the span, then the box picked out of it
        staging = torch.empty(span, dtype=dtype)

        def finish_span() -> None:
            dest.copy_(staging.as_strided(lengths, strides, 0))

        return _Read(item, dest, [_Segment(file, start, _bytes_of(staging))], span * size, finish_span)
    # run by run: the dims after the last partial one are whole, so each run is contiguous
    partial_dim = max(d for d in range(len(shape)) if lengths[d] != shape[d])
    run = lengths[partial_dim] * strides[partial_dim]
    staging = torch.empty(lengths, dtype=dtype)
    flat = _bytes_of(staging)
    segments = []
    outer = lengths[:partial_dim]
    count = 1
    for n in outer:
        count *= n
    for r in range(count):
        index, rest = [], r
        for n in reversed(outer):
            index.append(rest % n)
            rest //= n
        index.reverse()
        at = first + sum(i * s for i, s in zip(index, strides, strict=False))
        segments.append(_Segment(file, info.start + at * size, flat[r * run * size:(r + 1) * run * size]))

    def finish_runs() -> None:
        dest.copy_(staging)

    return _Read(item, dest, segments, numel * size, finish_runs)


def _read_segments(checkpoint: LocalSafetensors, segments: list[_Segment]) -> None:
    """Read every segment, adjacent ones (in the same file) together in one ``preadv``."""
    segments.sort(key=lambda s: (s.file, s.offset))
    i = 0
    while i < len(segments):
        head = segments[i]
        buffers, end, j = [head.into], head.offset + head.into.nbytes, i + 1
        while j < len(segments) and segments[j].file == head.file and segments[j].offset == end:
            buffers.append(segments[j].into)
            end += segments[j].into.nbytes
            j += 1
        checkpoint.read_into(head.file, head.offset, buffers)
        i = j


def run_local_load(planner: Any, state_dict: dict[str, Any], checkpoint: LocalSafetensors) -> None:
    """Plan ``state_dict``'s load from ``checkpoint`` with ``planner`` (a torch-protocol load
    planner that plans tensor reads only, e.g. :class:`HFLoadPlanner`) and carry it out (module
    docstring). Every rank of the default process group calls it together."""
    error = None
    try:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        planner.set_up_planner(state_dict, checkpoint.metadata(), rank == 0)
        plan = planner.finish_plan(planner.create_local_plan())
        items = list(plan.items)
        for item in items:
            if getattr(item.type, "name", str(item.type)) != "TENSOR":
                raise ValueError(f"the plan reads {item.dest_index.fqn!r} as bytes; only tensor reads are read "
                                 "straight from safetensors files")
    except Exception as exc:  # every rank learns that planning failed somewhere
        error = exc
    _agree(error, "planning the load")
    try:
        items.sort(key=lambda it: (checkpoint.file_of.get(it.storage_index.fqn, ""),
                                   checkpoint.tensors[it.storage_index.fqn].start
                                   if it.storage_index.fqn in checkpoint.tensors else 0))
        batch: list[_Read] = []
        staged = 0
        for item in items:
            read = _plan_read(checkpoint, item, planner.resolve_tensor(item))
            batch.append(read)
            staged += read.staged
            if staged >= MAX_STAGED_BYTES:
                _carry_out(planner, checkpoint, batch)
                batch, staged = [], 0
        _carry_out(planner, checkpoint, batch)
    except Exception as exc:
        error = exc
    _agree(error, "reading the checkpoint")


def _carry_out(planner: Any, checkpoint: LocalSafetensors, batch: list[_Read]) -> None:
    _read_segments(checkpoint, [s for read in batch for s in read.segments])
    for read in batch:
        if read.finish is not None:
            read.finish()
        planner.commit_tensor(read.item, read.dest)

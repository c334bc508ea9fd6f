"""Executes a rank's save plan: writes its chunks as safetensors files, checksummed on the way.

Each data file is a valid safetensors file: an 8-byte header length, a JSON header naming
one entry per chunk (``"<key>@<offsets>"``), then the chunks' bytes back to back. Bytes go
from tensor memory to the file with no intermediate copy; the crc32c of each block of rows
is computed just before the block is written, while it is still in cache.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import crc32c
import torch

from . import metadata as md
from .box import Box
from .planner import EntrySpec, SavePlan, SavePlanner, WriteItem
from .storage import StorageWriter
from .streams import StreamFence

BLOCK_BYTES = 4 << 20  # checksum granularity (rounded to whole rows of dim 0)


@dataclass
class WriteResult:
    """What one rank wrote: chunk records per key, JSON values it records, its files."""

    chunks: dict[str, list[md.ChunkRecord]] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    nbytes: int = 0


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a tensor's data, row-major, as a flat memoryview (copies only if it must)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def block_rows(sizes: tuple[int, ...], nbytes: int) -> int:
    rows = sizes[0] if sizes else 1
    row_bytes = max(1, nbytes // max(rows, 1))
    return max(1, min(rows, BLOCK_BYTES // row_bytes))


def _split_files(items: list[WriteItem], n: int) -> list[list[WriteItem]]:
    bins: list[list[WriteItem]] = [[] for _ in range(max(1, min(n, len(items))))]
    loads = [0] * len(bins)
    for item in sorted(items, key=lambda i: -i.nbytes):
        j = loads.index(min(loads))
        bins[j].append(item)
        loads[j] += item.nbytes
    for b in bins:  # keep a file's chunks in key order: nicer to inspect, same speed
        b.sort(key=lambda i: (i.key, i.box.offsets))
    return [b for b in bins if b]


def _header(items: list[WriteItem], entries: dict[str, EntrySpec], save_id: str) -> tuple[bytes, list[int]]:
    header: dict[str, Any] = {"__metadata__": {"format": md.FORMAT_NAME, "save_id": save_id}}
    starts, pos = [], 0
    for item in items:
        dtype = entries[item.key].dtype
        st = md.safetensors_dtype(dtype)
        shape = list(item.box.sizes) if st else [item.nbytes]
        name = f"{item.key}@{','.join(map(str, item.box.offsets))}"
        header[name] = {"dtype": st or "U8", "shape": shape, "data_offsets": [pos, pos + item.nbytes]}
        starts.append(pos)
        pos += item.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors allows space padding; keeps data 8-aligned
    base = 8 + len(raw)
    return struct.pack("<Q", len(raw)) + raw, [base + s for s in starts]


def write_plan(
    plan: SavePlan,
    planner: SavePlanner,
    writer: StorageWriter,
    rank: int,
    save_id: str,
    thread_count: int = 1,
) -> WriteResult:
    """Write every item of ``plan`` (this rank's share of the global plan)."""
    result = WriteResult()
    fence = StreamFence()  # device tensors are copied to the host on writer threads
    for key in plan.objects:
        result.objects[key] = planner.resolve_data(WriteItem(key, Box((), ()), 0))
    groups = _split_files(plan.items, thread_count)

    def write_group(index: int, items: list[WriteItem]) -> tuple[str, list[tuple[str, md.ChunkRecord]], int]:
        name = f"data-r{rank:05d}-{index}-{save_id}.safetensors"
        header, starts = _header(items, plan.entries, save_id)
        records: list[tuple[str, md.ChunkRecord]] = []

        def parts() -> Iterator[memoryview]:
            yield memoryview(header)
            for item, start in zip(items, starts, strict=False):
                value = planner.resolve_data(item)
                if isinstance(value, torch.Tensor):
                    fence.before_copy(value)
                data = tensor_bytes(value)
                if data.nbytes != item.nbytes:
                    raise ValueError(f"{item.key!r}: planned {item.nbytes} bytes, found {data.nbytes}")
                rows = item.box.sizes[0] if item.box.sizes else 1
                br = block_rows(item.box.sizes, item.nbytes)
                step = item.nbytes // rows * br
                crcs = []
                for off in range(0, item.nbytes, step):
                    block = data[off:off + step]
                    crcs.append(crc32c.crc32c(block))
                    yield block
                records.append((item.key, md.ChunkRecord(
                    item.box.offsets, item.box.sizes, name, start, item.nbytes, br, tuple(crcs))))

        written = writer.write_file(name, parts())
        return name, records, written

    if len(groups) > 1:
        with ThreadPoolExecutor(len(groups), thread_name_prefix="dcp-write") as pool:
            outs = list(pool.map(lambda a: write_group(*a), enumerate(groups)))
    else:
        outs = [write_group(i, g) for i, g in enumerate(groups)]
    for name, records, written in outs:
        result.files.append(name)
        result.nbytes += written
        for key, rec in records:
            result.chunks.setdefault(key, []).append(rec)
    return result


def data_file_names(rank: int, save_id: str, count: int) -> list[str]:
    """The names ``write_plan`` may use for a rank (to clean up after a failed save)."""
    return [f"data-r{rank:05d}-{i}-{save_id}.safetensors" for i in range(max(1, count))]


def build_metadata(
    plan: SavePlan, results: list[WriteResult], save_id: str, world_size: int, user: dict[str, Any]
) -> md.Metadata:
    """The coordinator's merge of every rank's write results into the checkpoint's metadata."""
    with md.paused_gc():
        return _build_metadata(plan, results, save_id, world_size, user)


def _build_metadata(
    plan: SavePlan, results: list[WriteResult], save_id: str, world_size: int, user: dict[str, Any]
) -> md.Metadata:
    chunks: dict[str, list[md.ChunkRecord]] = {}
    objects: dict[str, Any] = {}
    for r in results:
        for key, recs in r.chunks.items():
            chunks.setdefault(key, []).extend(recs)
        objects.update(r.objects)
    entries = {}
    for key, spec in plan.entries.items():
        recs = sorted(chunks.get(key, []), key=lambda c: c.offsets)
        entries[key] = md.Entry(
            key, spec.kind, spec.path, spec.dtype, spec.shape, recs, spec.layout, objects.get(key)
        )
    return md.Metadata(entries, save_id, world_size, user=user)


from .single_file import save_checkpoint  # noqa: E402, F401  (HyperParallel single-file API)

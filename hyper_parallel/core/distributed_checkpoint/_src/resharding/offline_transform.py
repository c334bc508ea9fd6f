"""offline_transform: a checkpoint rewritten for another parallel layout, offline, in one
process, without a process group, in bounded memory (TP=8 -> TP=4, PP=2 -> PP=1).

It checks the arguments (the source layout against the metadata, the target strategy's
mesh), sizes the memory budget, and runs :func:`~.reshard.reshard`.

Not here: format conversions (Hugging Face, full state dicts, torch DCP, MindSpore: the
modules of :mod:`..interop`); the streaming writer (:mod:`..engine.streaming_writer`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from ..backends.locations import location
from ..backends.resolve import reader_for
from ..engine.metadata_reader import read_checkpoint_metadata
from ..engine.streaming_writer import check_destination
from ..format import metadata as md
from ..format.chunks import largest_chunk_bytes
from ..interop.hyper_parallel.layout_files import load_layout
from ..sharding.layout import Layout, TensorLayout
from ..sharding.strategy import LayoutStrategy
from ..state.topology_mapper import MapperLike
from .reshard import reshard

SMALL_TENSOR = 4 << 20  # the default memory budget grows to keep tensors up to this size cached


def _as_strategy(value: Any) -> LayoutStrategy | None:
    if isinstance(value, (str, os.PathLike)):
        return load_layout(value)
    if isinstance(value, Mapping) and value and all(isinstance(v, TensorLayout) for v in value.values()):
        return LayoutStrategy(value)
    if isinstance(value, TensorLayout):
        raise TypeError("a single TensorLayout is not a strategy; pass {'*': layout} or a Layout (mesh)")
    return None


def _check_src_layout(meta: md.Metadata, src_layout: Any) -> None:
    strategy = _as_strategy(src_layout)
    if strategy is None:
        want = Layout.of(src_layout)
        for key, e in meta.entries.items():
            if e.layout and list(e.layout["mesh_shape"]) != list(want.mesh_shape):
                raise ValueError(f"src_layout mesh {list(want.mesh_shape)} does not match {key!r}, which was "
                                 f"saved on mesh {e.layout['mesh_shape']}")
        return
    for key, e in meta.entries.items():
        expected = strategy.match(key)
        if expected is None or e.layout is None:
            continue
        saved = TensorLayout.from_record(e.layout, ndim=len(e.shape or ()))
        if saved.tensor_map != expected.with_ndim(len(e.shape or ())).tensor_map or \
                tuple(saved.layout.mesh_shape) != tuple(expected.layout.mesh_shape):
            raise ValueError(f"src_layout says {key!r} has layout {expected}, but it was saved as {saved}")


def offline_transform(
    src_path: str | os.PathLike,
    dst_path: str | os.PathLike,
    src_layout: Any = None,
    dst_layout: Any = None,
    *,
    max_memory: int | None = None,
    verify: bool = True,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
    topology_mapper: MapperLike | None = None,
    min_chunk_bytes: int | None = None,
) -> md.Metadata:
    """Rewrite a checkpoint for another parallel layout, offline, in one process.

    ``topology_mapper`` renames keys on the way, e.g. for another pipeline split: a PP=2
    checkpoint whose stages numbered their layers from 0 becomes one whose keys are the
    whole model's, which a PP=1 job (or any split that uses whole-model names) loads
    without a mapper.

    Args:
        src_path: the checkpoint to convert.
        dst_path: a new directory for the result (``overwrite=True`` to replace a checkpoint).
        src_layout: optional; when given it is checked against the layouts the metadata
            recorded (a strategy, a layout JSON file, a :class:`Layout`, or ``{"tp": 8}``).
        dst_layout: the target: a strategy ``{name or glob: TensorLayout}``, a JSON file
            written by :func:`save_layout`, a :class:`Layout`/``DeviceMesh``, or a mesh
            mapping like ``{"tp": 4}`` (each tensor keeps its placements per mesh dim name).
        max_memory: bytes of tensor data held at once (default: four times the largest
            saved chunk, at least 64 MiB, raised to twice the total of the small tensors,
            up to 512 MiB, so that each small tensor split into thousands of destination
            chunks is read once); never the model size.
        verify: check the source's checksums while reading.
        progress: called with a byte count as each chunk is done (e.g. ``tqdm.update``).
        topology_mapper: the new name of each source key (source -> new, the direction a
            rewrite walks; a load planner's mapper goes target -> checkpoint): a
            :class:`~.topology_mapper.TopologyMapper`, a ``{source name: new name}``
            mapping, a callable, or ``(regex, replacement)`` rules; unmapped names stay.
            ``src_layout`` is checked against the source names, a ``dst_layout`` strategy
            matches the new names.
        min_chunk_bytes: store tensors whose destination shards would be smaller than this
            in chunks of several consecutive ranks' shards (see :func:`~.reshard.reshard`):
            e.g. ``64 << 10`` for a checkpoint of tens of thousands of ranks whose shards
            are a few rows each. Default None: a chunk and a file per rank.

    Raises:
        ValueError: ``src_layout`` disagrees with the checkpoint, the target mesh cannot
            hold a tensor, or ``topology_mapper`` maps two source keys to one name (the
            message names both).
        CheckpointError: ``dst_path`` already holds a checkpoint (without ``overwrite``).

    Example::

        offline_transform("ckpt_tp8", "ckpt_tp4", src_layout={"tp": 8}, dst_layout={"tp": 4})

        # PP=2 -> PP=1: stage s saved {"stage<s>": stage_sd} with 2 layers numbered from 0
        offline_transform("ckpt_pp2", "ckpt_pp1", dst_layout={"dp": 1}, topology_mapper=[
            (r"^stage(\\d+)\\.layers\\.(\\d+)\\.", lambda m: f"layers.{2 * int(m[1]) + int(m[2])}.")])
    """
    if dst_layout is None:
        raise ValueError("offline_transform needs dst_layout: a strategy, a layout file, a Layout or {'tp': 4}")
    if location(src_path) == location(dst_path):
        raise ValueError("dst_path must differ from src_path")
    check_destination(dst_path, overwrite)
    reader = reader_for(src_path)
    meta = read_checkpoint_metadata(reader)
    if src_layout is not None:
        _check_src_layout(meta, src_layout)
    if max_memory is None:
        max_memory = _memory_budget(meta)
    dst_mesh, rules = _destination(dst_layout)
    result = reshard(src_path, dst_path, dst_mesh=dst_mesh, rules=rules, max_memory=max_memory, verify=verify,
                     storage_reader=reader, progress=progress, topology_mapper=topology_mapper,
                     min_chunk_bytes=min_chunk_bytes)
    assert result is not None
    return result


def _memory_budget(meta: md.Metadata) -> int:
    """The default ``max_memory``: four times the largest saved chunk, at least 64 MiB, raised
    to twice the total of the small tensors up to 512 MiB (see :func:`offline_transform`)."""
    largest = max((largest_chunk_bytes(meta, e) for e in meta.entries.values()), default=0)
    small = sum(e.nbytes for e in meta.entries.values() if e.kind != "object" and e.nbytes <= SMALL_TENSOR)
    return max(64 << 20, 4 * largest, min(512 << 20, 2 * small))


def _destination(dst_layout: Any) -> tuple[Any, LayoutStrategy | None]:
    """``(dst_mesh, rules)`` for :func:`~.reshard.reshard` from a ``dst_layout``: a strategy's
    one mesh and the strategy itself, or the mesh as given and no rules."""
    strategy = _as_strategy(dst_layout)
    if strategy is None:
        return dst_layout, None
    meshes = {tl.layout for tl in strategy.values()}
    if len(meshes) != 1:
        raise ValueError(f"dst_layout uses {len(meshes)} meshes; a checkpoint is laid out for one")
    return meshes.pop(), strategy

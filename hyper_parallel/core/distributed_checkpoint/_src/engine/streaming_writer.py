"""The streaming checkpoint writer: a whole checkpoint written in one process, its data
produced item by item as it is written (offline converters and importers use it).

Peak memory is what one item's producer returns, never the model. The writer is the
ordinary one (:func:`~..transfer.saver.write_plan`, the commit protocol of
:mod:`.commit`) run for every "rank" in turn without a process group.

Not here: where the items come from (the converters of :mod:`..interop` and
:mod:`..resharding`), or distributed saves (:mod:`.checkpoint`).
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Callable
from typing import Any

from ..backends.protocol import StorageWriter
from ..backends.resolve import writer_for
from ..base.errors import CheckpointError
from ..coordination.coordinator import Coordinator
from ..format import metadata as md
from ..format.metadata_build import build_metadata
from ..planning.planner import EntrySpec, SavePlan, WriteItem
from ..transfer.saver import WriteResult, data_file_names, write_plan
from .commit import commit_and_agree, write_and_report


def check_destination(dst: str | os.PathLike | StorageWriter, overwrite: bool) -> None:
    """Refuse to replace a checkpoint at ``dst`` (a path, an fsspec URL or a writer) unless told to."""
    writer = dst if isinstance(dst, StorageWriter) else writer_for(dst)
    try:
        committed = writer.read_committed()
    except (NotADirectoryError, IsADirectoryError):
        raise CheckpointError(f"{_where(dst)!r} exists and is not a directory; a checkpoint is a directory") from None
    if not overwrite and committed is not None:
        raise CheckpointError(
            f"{_where(dst)!r} already holds a checkpoint; pass overwrite=True to replace it")


def _where(dst: str | os.PathLike | StorageWriter) -> str:
    if isinstance(dst, StorageWriter):
        return str(getattr(dst, "url", None) or getattr(dst, "path", None) or type(dst).__name__)
    return os.fspath(dst)


class _Lazy:
    """The saver's data resolver: produces each item's tensor only when it is written."""

    def __init__(self, produce: Callable[[WriteItem], Any]):
        self.produce = produce

    def resolve_data(self, item: WriteItem) -> Any:
        return self.produce(item)


def write_streaming(
    dst: str | os.PathLike,
    entries: dict[str, EntrySpec],
    files: list[list[WriteItem]],
    produce: Callable[[WriteItem], Any],
    *,
    overwrite: bool = False,
    sync_files: bool = True,
    user_metadata: dict[str, Any] | None = None,
) -> md.Metadata:
    """Write a checkpoint whose data is produced item by item (one data file per list).

    Object entries get their value from ``produce(WriteItem(key, Box((), ()), 0))``.
    """
    writer = writer_for(dst, sync_files)
    check_destination(writer, overwrite)
    writer.set_up(0, True)
    writer.prepare()
    save_id = uuid.uuid4().hex[:16]
    objects = [k for k, e in entries.items() if e.kind == "object"]
    resolver = _Lazy(produce)
    # Chunks of each key get ids 0..n-1 in the order given (they form the key's table).
    counts: dict[str, int] = {}
    numbered = []
    for items in files or [[]]:
        row = []
        for item in items:
            row.append(WriteItem(item.key, item.box, item.nbytes, counts.get(item.key, 0)))
            counts[item.key] = counts.get(item.key, 0) + 1
        numbered.append(row)
    specs = {k: EntrySpec(e.kind, e.path, e.dtype, e.shape, e.layout) for k, e in entries.items()}
    # A layout's mesh may be larger than the number of files (replicas written once).
    world = max([len(files), 1] + [math.prod(e.layout["mesh_shape"]) for e in entries.values() if e.layout])
    coord = Coordinator(None, no_dist=True)
    own = [n for r in range(len(numbered)) for n in data_file_names(r, save_id, 1)]
    what = f"writing {_where(dst)}"

    def write_all() -> list[WriteResult]:
        return [write_plan(SavePlan(specs, items, objects if rank == 0 else []), resolver, writer, rank, save_id)
                for rank, items in enumerate(numbered)]

    results = write_and_report(coord, writer, "write", write_all, own, what, save_id)[0]
    meta = commit_and_agree(
        coord, writer, "commit",
        lambda: build_metadata(specs, results, save_id, world, user_metadata or {}),
        own, what, save_id)
    assert meta is not None
    return meta

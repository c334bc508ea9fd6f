"""torch DCP's ``create_read_items_for_chunk_list``: the reads that fill local chunks from saved ones.

Given a key's saved chunks (torch's ``TensorStorageMetadata``, as our
``Metadata.state_dict_metadata`` serves them) and the chunks a rank wants, every overlap of a
wanted chunk with a saved chunk is one read, computed with our box intersection
(:class:`~..base.box.Box`). The result is torch's ``ReadItem`` records (plain data, torch's
field names), for code that plans with them; our own planner plans in boxes
(:mod:`.standard_planner`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..base.box import Box
from ..format.records import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from .records import LoadItemType, ReadItem

__all__ = ["create_read_items_for_chunk_list"]


def _box(chunk: ChunkStorageMetadata) -> Box:
    return Box(tuple(int(o) for o in chunk.offsets), tuple(int(s) for s in chunk.sizes))


def create_read_items_for_chunk_list(
    fqn: str,
    checkpoint_md: TensorStorageMetadata,
    local_chunks: Sequence[ChunkStorageMetadata],
) -> list[ReadItem]:
    """One ``ReadItem`` per overlap of a local chunk with a saved chunk of ``fqn``.

    ``dest_offsets`` are relative to the local chunk, ``storage_offsets`` to the saved one;
    ``dest_index``/``storage_index`` name the chunk by its global offsets and its position in
    ``local_chunks`` / ``checkpoint_md.chunks``. Local chunks come in their order, and for
    each, the saved chunks it overlaps in theirs.

    Example::

        md = FileSystemReader(path).read_metadata().state_dict_metadata["w"]
        reads = create_read_items_for_chunk_list("w", md, [ChunkStorageMetadata(offsets, sizes)])
    """
    saved = [_box(c) for c in checkpoint_md.chunks]
    items: list[ReadItem] = []
    for li, local_chunk in enumerate(local_chunks):
        want = _box(local_chunk)
        for si, have in enumerate(saved):
            overlap = want.intersect(have)
            if overlap is None:
                continue
            items.append(ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(fqn, local_chunk.offsets, li),
                dest_offsets=torch.Size(o - w for o, w in zip(overlap.offsets, want.offsets, strict=True)),
                storage_index=MetadataIndex(fqn, checkpoint_md.chunks[si].offsets, si),
                storage_offsets=torch.Size(o - h for o, h in zip(overlap.offsets, have.offsets, strict=True)),
                lengths=torch.Size(overlap.sizes),
            ))
    return items
